"""Training samples as they cross Ray: numeric fields may be lists or numpy arrays (plain lists cross far
faster than 64 samples x 4 small tensors, each pickled on its own); a backend turns them into tensors."""

from __future__ import annotations

NON_TENSOR_FIELDS = ("images", "where")
INTEGER_FIELDS = ("input_ids", "teacher_topk_ids")
BOOL_FIELDS = ("loss_mask",)


def as_tensors(sample: dict) -> dict:
    """`sample` with tensors in place of its numeric fields (in place): ids long, masks bool, rest float32."""
    import torch

    for k, v in sample.items():
        if k in NON_TENSOR_FIELDS or isinstance(v, torch.Tensor):
            continue
        dtype = torch.long if k in INTEGER_FIELDS else torch.bool if k in BOOL_FIELDS else torch.float32
        sample[k] = torch.as_tensor(v, dtype=dtype)
    return sample
