"""NeMo RL's recipe keys and where gymv keeps the same setting, so that a recipe ported from NeMo RL is told,
key by key, what gymv calls it (the loader and `gymv lint`; docs/nemo-rl.md has the table and the metrics).

A value is gymv's dotted key, optionally followed by a note in parentheses; a `<alias>` segment of a NeMo RL key
stands for any one name. gymv's keys under `grpo.` are under `mopd.` in a MOPD recipe, where gymv has them there
(NeMo RL's MOPD runs on its GRPO config).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gymv.config.schema import MopdSection, base_algorithm

KEYS: dict[str, str] = {
    # grpo
    "grpo.num_prompts_per_step": "grpo.prompts_per_step",
    "grpo.num_generations_per_prompt": "grpo.generations_per_prompt",
    "grpo.max_num_steps": "grpo.max_steps",
    "grpo.max_rollout_turns": "env.max_turns",
    "grpo.max_val_samples": "grpo.val_prompts",
    "grpo.seed": "seed",
    "grpo.use_leave_one_out_baseline": "grpo.advantage.baseline (true: leave_one_out, false: mean)",
    "grpo.normalize_rewards": "grpo.advantage.normalize_std",
    "grpo.adv_estimator.use_leave_one_out_baseline": "grpo.advantage.baseline (true: leave_one_out, false: mean)",
    "grpo.adv_estimator.normalize_rewards": "grpo.advantage.normalize_std",
    "grpo.adv_estimator.name": "algorithm (grpo: grpo or vlm_grpo; opd: mopd or vlm_mopd)",
    "grpo.val_period": "grpo.val_period",  # the same name: listed for MOPD recipes, where it is mopd.val_period
    "grpo.val_at_start": "grpo.val_at_start",
    "grpo.seq_logprob_error_threshold": "grpo.seq_logprob_error_threshold",
    "grpo.overlong_filtering": "grpo.overlong_filtering",
    "grpo.async_grpo.enabled": "grpo.async.enabled (or `gymv train --async`)",
    "grpo.async_grpo.max_trajectory_age_steps": "grpo.async.max_trajectory_age_steps",
    "grpo.async_grpo.in_flight_weight_updates": "grpo.async.in_flight_weight_updates",
    # loss_fn
    "loss_fn.reference_policy_kl_penalty": "grpo.loss.kl_coef",
    "loss_fn.reference_policy_kl_type": "grpo.loss.kl_estimator",
    "loss_fn.ratio_clip_min": "grpo.loss.clip_low",
    "loss_fn.ratio_clip_max": "grpo.loss.clip_high",
    "loss_fn.token_level_loss": "grpo.loss.aggregation (true: token_mean, false: seq_mean_token_mean)",
    "loss_fn.use_importance_sampling_correction":
        "grpo.importance_sampling.kind (truncated, icepop or seq_mask_tis; false: none)",
    "loss_fn.truncated_importance_sampling_type":
        "grpo.importance_sampling.kind (tis: truncated, icepop: icepop, seq-mask-tis: seq_mask_tis)",
    "loss_fn.truncated_importance_sampling_ratio":
        "grpo.importance_sampling.truncate_max (icepop, seq-mask-tis: gate_high)",
    "loss_fn.truncated_importance_sampling_ratio_min":
        "grpo.importance_sampling.truncate_min (icepop, seq-mask-tis: gate_low)",
    # policy
    "policy.model_name": "model.path",
    "policy.max_total_sequence_length": "model.max_seq_len",
    "policy.precision": "training.dtype",
    "policy.train_global_batch_size": "training.global_batch_size",
    "policy.max_grad_norm": "training.max_grad_norm",
    "policy.optimizer.kwargs.lr": "training.lr",
    "policy.optimizer.kwargs.weight_decay": "training.weight_decay",
    "policy.optimizer.kwargs.betas": "training.betas",
    "policy.optimizer.kwargs.eps": "training.eps",
    "policy.tokenizer.chat_template_kwargs": "generation.chat_template_kwargs",
    "policy.sequence_packing.enabled": "training.sequence_packing",
    "policy.dtensor_cfg.activation_checkpointing": "training.gradient_checkpointing",
    "policy.megatron_cfg.activation_checkpointing": "training.gradient_checkpointing",
    "policy.megatron_cfg.tensor_model_parallel_size": "training.parallel.tensor",
    "policy.megatron_cfg.pipeline_model_parallel_size": "training.parallel.pipeline",
    "policy.megatron_cfg.context_parallel_size": "training.parallel.context",
    "policy.megatron_cfg.expert_model_parallel_size": "training.parallel.expert",
    "policy.generation.backend": "generation.backend",
    "policy.generation.temperature": "generation.temperature",
    "policy.generation.top_p": "generation.top_p",
    "policy.generation.max_new_tokens": "generation.max_new_tokens",
    "policy.generation.stop_strings": "generation.stop_strings",
    "policy.generation.vllm_cfg.gpu_memory_utilization": "generation.vllm.gpu_memory_utilization",
    "policy.generation.vllm_cfg.tensor_parallel_size": "generation.vllm.tensor_parallel_size",
    "policy.generation.vllm_cfg.enforce_eager": "generation.vllm.enforce_eager",
    "policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update":
        "generation.reset_encoder_cache_after_weight_update (true in gymv's exemplars, false by NeMo RL's default: "
        "features cached under older weights would be reused)",
    "policy.generation.colocated.enabled": "cluster.colocated",
    "policy.generation.vllm_kwargs": "generation.vllm.engine_kwargs (the same mapping; gymv refuses the arguments it sets)",
    "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser":
        "rollout.tool_call_format (hermes and qwen3_coder by the same names, llama3_json: llama3)",
    # checkpointing, logger
    "checkpointing.checkpoint_dir": "checkpoint.dir",
    "checkpointing.save_period": "checkpoint.period",
    "checkpointing.keep_top_k": "checkpoint.keep (gymv keeps the newest, not the best)",
    "logger.tensorboard_enabled": "logger.tensorboard",
    "logger.wandb_enabled": "logger.wandb",
    "logger.wandb.project": "logger.wandb_project",
    # on-policy distillation (MOPD)
    "on_policy_distillation.teacher_model_by_agent_name":
        "mopd.teachers (alias -> checkpoint) and mopd.agent_to_teacher (agent -> alias)",
    "on_policy_distillation.default_teacher_alias": "mopd.default_teacher_alias",
    "on_policy_distillation.strict_agent_name_match": "mopd.strict_agent_name_match (gymv's default is true)",
    "on_policy_distillation.non_colocated_teachers.enabled": "mopd.teachers.<alias>.placement (true: separate)",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.tensor_model_parallel_size":
        "mopd.teachers.<alias>.tensor_parallel_size (each teacher's)",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.expert_model_parallel_size":
        "mopd.teachers.<alias>.expert_parallel_size (each teacher's)",
    "on_policy_distillation.non_colocated_teachers.teacher_overrides.<alias>.tensor_model_parallel_size":
        "mopd.teachers.<alias>.tensor_parallel_size",
    "on_policy_distillation.non_colocated_teachers.teacher_overrides.<alias>.expert_model_parallel_size":
        "mopd.teachers.<alias>.expert_parallel_size",
    "grpo.deduplicate_multimodal_data": "vision.dedup_payloads",
}

SECTIONS: dict[str, str] = {
    "loss_fn": "`grpo.loss` and `grpo.importance_sampling` (MOPD: `mopd.importance_sampling`)",
    "policy": "`model`, `training` and `generation`",
    "checkpointing": "`checkpoint`",
    "on_policy_distillation": "`mopd`",
    "grpo.async_grpo": "`grpo.async`",
    "grpo.adv_estimator": "`grpo.advantage`",
}


def _leaves(path: tuple, value: Any) -> Iterator[tuple]:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(path + (str(k),), v)
    else:
        yield path


def _gymv_name(hint: str, section: str) -> tuple[str, str]:
    """(gymv's key, the note after it) of a KEYS value; gymv's `grpo.` keys are `mopd.` keys in a MOPD recipe
    (where gymv has the key there)."""
    name, _, note = hint.partition(" ")
    mopd_keys = {f.alias or n for n, f in MopdSection.model_fields.items()}
    if section == "mopd" and name.startswith("grpo.") and name.split(".")[1] in mopd_keys:
        name = "mopd." + name[len("grpo."):]
    return name, note


def _in_section(hint: str, section: str) -> str:
    """The hint with gymv's key quoted."""
    name, note = _gymv_name(hint, section)
    return f"`{name}`" + (f" {note}" if note else "")


_PATTERNS = [k for k in KEYS if "<alias>" in k]


def _entry(key: str) -> str | None:
    """The KEYS entry written for NeMo RL's `key` itself (a `<alias>` segment matching any name)."""
    if key in KEYS:
        return key
    parts = key.split(".")
    return next((p for p in _PATTERNS if len(p.split(".")) == len(parts)
                 and all(a in ("<alias>", b) for a, b in zip(p.split("."), parts))), None)


def _known(leaf: tuple) -> tuple:
    """The NeMo RL key of the table that `leaf` is, or is an entry of (a mapping-valued key: vllm_kwargs); else
    `leaf` itself."""
    return next((leaf[:i] for i in range(len(leaf), 0, -1) if _entry(".".join(leaf[:i]))), leaf)


def nemo_rl_names(path: tuple, value: Any, section: str = "grpo") -> list[tuple[tuple, str]]:
    """(path, fix) for each NeMo RL key at or under an unknown key `path` of a recipe of algorithm family
    `section`: its gymv name; for a NeMo RL section, also where gymv keeps its settings."""
    out = []
    for leaf in dict.fromkeys(_known(leaf) for leaf in _leaves(path, value)):
        nemo = ".".join(leaf)
        entry = _entry(nemo)
        # a key gymv spells the same way is unknown for another reason (a section of another algorithm):
        # "gymv's name is the same name" would be no help
        if entry and _gymv_name(KEYS[entry], section)[0] != nemo:
            out.append((leaf, f"`{nemo}` is NeMo RL's name: gymv's is {_in_section(KEYS[entry], section)} "
                              "(docs/nemo-rl.md)"))
    key = ".".join(path)
    if key in SECTIONS:
        out.append((path, f"`{key}` is NeMo RL's section: gymv keeps its settings in {SECTIONS[key]} "
                          "(docs/nemo-rl.md)"))
    return out


def override_hint(key: str, algorithm: str | None) -> str | None:
    """The fix for a command-line override of NeMo RL's key `key`, or None when it is not one."""
    key = ".".join(_known(tuple(key.split("."))))
    if _entry(key) is None:
        return None
    names = nemo_rl_names(tuple(key.split(".")), None, base_algorithm(str(algorithm or "grpo")))
    return names[0][1] if names else None
