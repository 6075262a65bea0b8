"""`gymv model`: write tiny random-initialised VLM checkpoints and describe any policy checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer

from gymv_cli.output import console, err_console, print_json, table

app = typer.Typer(
    name="model",
    help="Build and inspect policy checkpoints.\n\nExample: gymv model init tiny-llava models/tiny-llava",
    no_args_is_help=True,
)


@app.command("init")
def init(
    arch: str = typer.Argument(..., metavar="ARCH", help="Architecture: tiny-llava, tiny-llava-next, tiny-llava-onevision, tiny-qwen2vl, "
                                         "tiny-qwen2_5vl, tiny-qwen3vl, tiny-gemma3, tiny-smolvlm, the hybrid "
                                         "Mamba/attention/MoE tiny-nemotron-omni, or the text-only "
                                         "tiny-qwen3 and tiny-llama (docs/models.md)."),
    out_dir: Path = typer.Argument(..., help="Folder to write the Hugging Face checkpoint to."),
    hidden: int = typer.Option(None, "--hidden", help="Text model width (default 128)."),
    layers: int = typer.Option(None, "--layers", help="Text decoder layers (default 2)."),
    vision_layers: int = typer.Option(None, "--vision-layers", help="Vision encoder layers (default 2)."),
    image_size: int = typer.Option(None, "--image-size", help="Image side in pixels (default 56 LLaVA, 112 Qwen2-VL)."),
    patch_size: int = typer.Option(None, "--patch-size", help="Vision patch size (default 7)."),
    vocab_size: int = typer.Option(None, "--vocab-size", help="BPE vocabulary size (default 1024)."),
    layer_pattern: str = typer.Option(None, "--layer-pattern",
                                      help="tiny-nemotron-omni: layer letters, M Mamba-2, * attention, E MoE, - MLP "
                                           "(default ME*E; sets the layer count)."),
    experts: int = typer.Option(None, "--experts", help="tiny-nemotron-omni: routed experts per MoE layer (default 4)."),
    top_k: int = typer.Option(None, "--top-k", help="tiny-nemotron-omni: experts each token is routed to (default 2)."),
    mtp_layers: int = typer.Option(None, "--mtp-layers",
                                   help="tiny-nemotron-omni: num_nextn_predict_layers, the MTP switch (default 0)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the tokenizer corpus and the weights."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Write a random-initialised tiny model: a VLM + processor that AutoModelForImageTextToText loads, or a
    text-only causal LM (tiny-qwen3, tiny-llama) that AutoModelForCausalLM loads.

    Example: gymv model init tiny-llava models/tiny --layers 4 --seed 1
    Example: gymv model init tiny-nemotron-omni models/omni --layer-pattern 'ME*EME*E' --experts 8 --top-k 2
    """
    from gymv.models.tiny import count_parameters, init_tiny

    knobs = dict(hidden=hidden, layers=layers, vision_layers=vision_layers, image_size=image_size, patch_size=patch_size,
                 vocab_size=vocab_size, seed=seed, layer_pattern=layer_pattern, experts=experts,
                 experts_per_token=top_k, mtp_layers=mtp_layers)
    with err_console.status(f"building {arch}"):
        path = init_tiny(arch, out_dir, force=force, **knobs)
    summary = _summary(path)
    summary["parameters"] = count_parameters(path)
    if json_out:
        print_json(summary)
    else:
        console.print(table(f"wrote {path}", ["key", "value"], [(k, _fmt(v)) for k, v in summary.items()]))


@app.command("info")
def info(
    path: str = typer.Argument(..., help="Checkpoint folder, hub id (from the local cache), or embedded:<tiny arch>."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Load a policy and show its processor style, image tokens and vision special tokens.

    Example: gymv model info models/tiny --json
    """
    from gymv.backends.policy import load_policy

    with err_console.status(f"loading {path}"):
        policy = load_policy(path)
    summary = {"path": str(policy.path), **policy.info, **policy.adapter.describe(),
               "parameters": sum(p.numel() for p in policy.model.parameters()),
               "vocab_size": len(policy.tokenizer)}
    if policy.adapter.style == "placeholder":
        summary["tokens_per_image"] = policy.adapter.num_image_tokens
    if json_out:
        print_json(summary)
    else:
        console.print(table(str(policy.path), ["key", "value"], [(k, _fmt(v)) for k, v in summary.items()]))


def _summary(path: Path) -> dict:
    import json

    meta = json.loads((Path(path) / "gymv_model.json").read_text())
    return {"path": str(path), "arch": meta["arch"], **meta["knobs"]}


def _fmt(v) -> str:
    return ", ".join(map(str, v)) if isinstance(v, list) else str(v)
