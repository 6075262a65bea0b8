"""Which turn broke an image span: the placeholder check, with the row and turn in its message.

`adapter.check` says that a sequence's placeholder spans do not fit its images. When a multi-turn
sequence fails it, the useful fact is where: which span, whether the model sampled it or the environment
inserted it, and at which turn. The token positions of each model call (`model_calls`) answer that.
"""

from __future__ import annotations

from collections.abc import Sequence

from gymv.errors import GymvError


def turn_of_position(pos: int, model_calls: Sequence[dict]) -> tuple[int, str]:
    """(turn, "sampled" | "inserted") of token `pos`: turn 0 is the prompt, turn k follows model call k-1."""
    turn = 0
    for c in model_calls:
        if pos < c["generation_start"]:
            return turn, "inserted"
        if pos < c["generation_end"]:
            return c["turn"], "sampled"
        turn = c["turn"] + 1
    return turn, "inserted"


def _spans(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `token`."""
    out: list[tuple[int, int]] = []
    for k, t in enumerate(ids):
        if t != token:
            continue
        if out and out[-1][0] + out[-1][1] == k:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((k, 1))
    return out


def _first_mismatch(adapter, ids: Sequence[int], images: Sequence, image_turns: Sequence[int],
                    model_calls: Sequence[dict]) -> tuple[int, str]:
    need = [adapter.tokens_per_image(im) for im in images]
    merge = getattr(adapter, "adjacent_images_merge", False)
    i = 0
    for start, length in _spans(ids, adapter.image_token_id):
        turn, kind = turn_of_position(start, model_calls)
        if i >= len(need):
            return turn, (f"the image placeholder span at token {start} ({length} tokens, {kind} at turn {turn}) "
                          "belongs to no image")
        first, got = i, 0
        while got < length and i < len(need):
            got += need[i]
            i += 1
            if not merge:
                break
        if got != length:
            return turn, (f"the image placeholder span at token {start} ({kind} at turn {turn}) has {length} tokens "
                          f"where image {first} (introduced at turn {image_turns[first]}) needs {need[first]}")
    if i < len(need):
        return image_turns[i], f"image {i} (introduced at turn {image_turns[i]}) has no placeholder span"
    return (model_calls[-1]["turn"] + 1 if model_calls else 0), "the placeholder spans do not match the images"


def check_image_spans(adapter, ids: Sequence[int], images: Sequence, image_turns: Sequence[int],
                      model_calls: Sequence[dict], *, where: str) -> None:
    """Raise a GymvError naming `where` (the row) and the turn of the first bad span, unless the placeholder
    spans of `ids` are exactly the spans `images` need (the check before every forward pass)."""
    try:
        adapter.check(ids, images, where=where)
    except GymvError as e:
        turn, detail = _first_mismatch(adapter, list(ids), images, image_turns, model_calls)
        raise GymvError(f"{detail}; {e.message}", where=f"{where}, turn {turn}", fix=e.fix) from None


def check_trajectory_images(traj, adapter, *, where: str | None = None) -> None:
    """The same check on a finished trajectory (what a trainer may run before its forward pass)."""
    check_image_spans(adapter, traj.token_ids, traj.images, traj.image_turns, traj.model_calls,
                      where=where or f"row {traj.task_index} sample {traj.sample_index}")
