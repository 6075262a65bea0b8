"""NeMo RL's recipe keys and where gymv keeps the same setting, so that a recipe ported from NeMo RL is told,
key by key, what gymv calls it (the loader and `gymv lint`; docs/nemo-rl.md has the table and the metrics).

A value of KEYS is gymv's dotted key, optionally followed by a note in parentheses; NO_KEY says why gymv has
no counterpart of a NeMo RL key (what gymv does instead). Either table may name a mapping-valued key or a section,
which then speaks for every key under it, and a `<alias>` segment stands for any one name. gymv's keys under
`grpo.` are under `mopd.` in a MOPD recipe, where gymv has them there (NeMo RL's MOPD runs on its GRPO config).
Every key of the reference Nemotron Omni recipes is in one table or the other (tests/nemo_rl_reference).
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
    "grpo.advantage_clip_low": "grpo.advantage.clip_low",
    "grpo.advantage_clip_high": "grpo.advantage.clip_high",
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
        "grpo.importance_sampling.kind (tis: truncated, icepop: icepop, seq-mask-tis: seq_mask_tis; null with the "
        "correction on: truncated with truncate_max: null, the raw ratio)",
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
    "checkpointing.enabled": "checkpoint.enabled",
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
    # the reference Nemotron Omni recipes' other keys gymv has (docs/nemo-rl.md, "The Omni reference recipes")
    "grpo.deduplicate_multimodal_data": "vision.dedup_payloads",
    "on_policy_distillation.enabled": "algorithm (true: mopd or vlm_mopd)",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.tensor_model_parallel_size":
        "mopd.teachers.<alias>.tensor_parallel_size (each teacher's)",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.expert_model_parallel_size":
        "mopd.teachers.<alias>.expert_parallel_size (each teacher's)",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.num_nodes":
        "mopd.teachers.<alias>.gpus (num_nodes x gpus_per_node)",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.gpus_per_node":
        "mopd.teachers.<alias>.gpus (num_nodes x gpus_per_node)",
    "on_policy_distillation.non_colocated_teachers.default_teacher_cfg.precision":
        "training.dtype (teachers score in it)",
    "on_policy_distillation.non_colocated_teachers.teacher_overrides.<alias>.tensor_model_parallel_size":
        "mopd.teachers.<alias>.tensor_parallel_size",
    "on_policy_distillation.non_colocated_teachers.teacher_overrides.<alias>.expert_model_parallel_size":
        "mopd.teachers.<alias>.expert_parallel_size",
    "policy.is_vlm": "algorithm (true: vlm_grpo, vlm_mopd or vlm_sft)",
    "policy.train_micro_batch_size": "training.micro_batch_tokens (tokens, not sequences)",
    "policy.dtensor_cfg.enabled": "training.backend (true: fsdp2)",
    "policy.dtensor_cfg.cpu_offload": "training.fsdp.cpu_offload",
    "policy.megatron_cfg.enabled": "training.backend (true: megatron)",
    "policy.megatron_cfg.recompute_granularity": "training.gradient_checkpointing (whole layers)",
    "policy.megatron_cfg.optimizer.lr": "training.lr",
    "policy.megatron_cfg.optimizer.min_lr": "training.min_lr_ratio (min_lr / lr)",
    "policy.megatron_cfg.optimizer.weight_decay": "training.weight_decay",
    "policy.megatron_cfg.optimizer.adam_beta1": "training.betas ([beta1, beta2])",
    "policy.megatron_cfg.optimizer.adam_beta2": "training.betas ([beta1, beta2])",
    "policy.megatron_cfg.optimizer.adam_eps": "training.eps",
    "policy.megatron_cfg.optimizer.clip_grad": "training.max_grad_norm",
    "policy.megatron_cfg.scheduler.lr_decay_style": "training.lr_schedule",
    "policy.megatron_cfg.scheduler.lr_warmup_iters": "training.warmup_steps",
    "policy.megatron_cfg.scheduler.lr_warmup_init": "training.warmup_init_ratio (lr_warmup_init / lr)",
    "policy.megatron_cfg.moe_router_bias_update_rate": "training.moe.router_bias_update_rate",
    "policy.megatron_cfg.moe_router_enable_expert_bias": "training.moe.router_bias_update_rate (> 0 updates the bias)",
    "policy.megatron_cfg.moe_aux_loss_coeff": "training.moe.aux_loss_coef",
    "policy.megatron_cfg.freeze_moe_router": "training.moe.freeze_router",
    "policy.megatron_cfg.moe_router_load_balancing_type": "training.moe.aux_loss_coef (none: 0)",
    "policy.generation.refit_transport": "refit.transport",
    "policy.generation.colocated.resources": "cluster.generation_gpus (num_nodes x gpus_per_node)",
    "policy.generation.vllm_cfg.max_model_len": "model.max_seq_len",
    "policy.generation.vllm_cfg.precision": "model.dtype",
    "policy.generation.vllm_kwargs.limit_mm_per_prompt": "vision.max_images_per_sample (image: N)",
    "env.should_use_nemo_gym": "rollout.driver (nemo_gym_agents: NeMo Gym's agent servers; gymv's built-in "
                               "environments follow NeMo Gym's rules)",
    "env.should_log_nemo_gym_responses": "logger.log_rollouts",
    "env.nemo_gym.config_paths": "env.name (the environment, by gymv's name)",
    "data.train.data_path": "data.train",
    "data.validation.data_path": "data.eval",
    "data.max_input_seq_length": "model.max_seq_len (it bounds prompts too)",
    "logger.wandb.name": "name (the run's name)",
    "logger.wandb.log_nemo_gym_full_result_tables": "logger.log_rollouts",
    "logger.mlflow_enabled": "logger.plugins (a logger plugin)",
    "logger.swanlab_enabled": "logger.plugins (a logger plugin)",
}

# NeMo RL keys (or sections) with no gymv counterpart: what gymv does instead
NO_KEY: dict[str, str] = {
    # grpo
    "grpo.max_num_epochs": "gymv goes round the rows until max_steps",
    "grpo.adv_estimator.minus_baseline": "gymv always subtracts the baseline",
    "grpo.use_dynamic_sampling": "gymv keeps every group",
    "grpo.dynamic_sampling_max_gen_batches": "gymv keeps every group",
    "grpo.batch_multiplier": "gymv keeps every group",
    "grpo.zero_variance_prompt_filtering": "gymv keeps groups whose rewards are all equal "
                                           "(train/zero_std_group_fraction counts them)",
    "grpo.reward_shaping": "gymv does not shape rewards",
    "grpo.reward_scaling": "gymv does not scale rewards",
    "grpo.invalid_tool_call_advantage": "gymv overrides no advantage",
    "grpo.malformed_thinking_advantage": "gymv overrides no advantage",
    "grpo.debug_payload_metrics": "payload debugging metrics",
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": "it applies to in-flight weight updates; gymv's "
                                                               "vLLM engine drops its prefix cache after every refit",
    "grpo.async_grpo.max_generation_failures": "gymv's failure limits are env.max_failed_fraction and "
                                               "env.max_failed_fraction_window",
    "grpo.val_at_end": "gymv validates at the last step whenever val_period > 0",
    "grpo.val_start_at": "gymv validates every val_period steps from the start",
    "grpo.val_num_generations_per_prompt": "gymv validates one greedy rollout a prompt",
    "grpo.num_val_generations_per_prompt": "gymv validates one greedy rollout a prompt",
    "grpo.val_batch_size": "gymv batches validation itself",
    "grpo.stop_at_validation_metric": "gymv does not stop early on a validation metric",
    "grpo.stop_at_validation_threshold": "gymv does not stop early on a validation metric",
    "reward_penalties": "gymv adds no reward penalties",
    # loss_fn
    "loss_fn.kl_input_clamp_value": "gymv does not clamp the KL estimate",
    "loss_fn.kl_output_clamp_value": "gymv does not clamp the KL estimate",
    "loss_fn.use_on_policy_kl_approximation": "gymv's KL term is not importance-weighted",
    "loss_fn.use_kl_in_reward": "gymv's KL is a loss term (grpo.loss.kl_coef)",
    "loss_fn.ratio_clip_c": "gymv has no dual clip",
    "loss_fn.disable_ppo_ratio": "the algorithm decides: GRPO's loss clips the ratio, MOPD's is REINFORCE on the "
                                 "teacher gap",
    "loss_fn.force_on_policy_ratio": "gymv's ratio is always against the logprobs before the step",
    "loss_fn.use_cispo": "gymv has no CISPO loss",
    "loss_fn.positive_example_nll_weight": "gymv adds no NLL term",
    "loss_fn.sequence_level_importance_ratios": "gymv's ratios are per token (importance_sampling.kind "
                                                "seq_mask_tis drops whole sequences)",
    # checkpointing
    "checkpointing.metric_name": "gymv keeps the newest checkpoints (checkpoint.keep), not the best",
    "checkpointing.higher_is_better": "gymv keeps the newest checkpoints (checkpoint.keep), not the best",
    "checkpointing.checkpoint_must_save_by": "gymv stops after checkpoint.steps_per_run steps, not at a deadline",
    "checkpointing.model_save_format": "gymv saves safetensors and exports final/ as a transformers folder",
    "checkpointing.save_consolidated": "gymv saves safetensors and exports final/ as a transformers folder",
    "checkpointing.save_optimizer": "gymv always saves the optimizer state",
    # policy
    "policy.tokenizer.name": "gymv uses the checkpoint's own tokenizer",
    "policy.tokenizer.chat_template": "gymv uses the checkpoint's own chat template",
    "policy.tokenizer.use_fastokens": "a tokenizer implementation",
    "policy.hf_config_overrides": "gymv loads the checkpoint's config as it is",
    "policy.generation_batch_size": "how the engines batch; gymv's trainers batch by training.micro_batch_tokens",
    "policy.logprob_batch_size": "how the engines batch; gymv's trainers batch by training.micro_batch_tokens",
    "policy.logprob_chunk_size": "how the engines batch; gymv's trainers batch by training.micro_batch_tokens",
    "policy.offload_optimizer_for_logprob": "a memory setting",
    "policy.make_sequence_length_divisible_by": "padding for Megatron's tensor and context parallelism",
    "policy.optimizer": "gymv's optimizer is AdamW on every backend: training.lr, weight_decay, betas, eps",
    "policy.scheduler": "gymv's schedule: training.warmup_steps, lr_schedule, min_lr_ratio",
    "policy.draft": "gymv trains no draft model",
    "policy.dynamic_batching": "gymv packs micro-batches by training.micro_batch_tokens",
    "policy.sequence_packing": "gymv packs micro-batches by training.micro_batch_tokens (training.sequence_packing "
                               "switches it)",
    "policy.dtensor_cfg": "gymv's sharded trainer is training.backend fsdp2 (training.fsdp.*)",
    "policy.dtensor_cfg.lora_cfg": "gymv trains every weight (no LoRA)",
    "policy.megatron_cfg": "a Megatron-core setting gymv does not expose (its sizes are training.parallel.*, its "
                           "optimizer training.*)",
    "policy.megatron_cfg.optimizer": "gymv's AdamW: training.lr, weight_decay, betas, eps, max_grad_norm",
    "policy.megatron_cfg.expert_tensor_parallel_size": "gymv's megatron backend keeps each expert whole under "
                                                       "training.parallel.expert > 1 (expert tensor parallel size 1, "
                                                       "the reference's); at expert 1 experts split over "
                                                       "training.parallel.tensor",
    "policy.megatron_cfg.scheduler": "gymv's schedule: training.warmup_steps, warmup_init_ratio, lr_schedule, min_lr_ratio",
    "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32": "gymv's FSDP2 reduces gradients "
                                                                                 "in float32",
    "policy.megatron_cfg.moe_router_dtype": "the Nemotron Omni router computes in float32 in transformers",
    "policy.megatron_cfg.mtp_num_layers": "gymv builds no MTP layer",
    "policy.megatron_cfg.peft": "gymv trains every weight (no LoRA)",
    "policy.megatron_cfg.freeze_vision_model": "gymv trains every weight",
    "policy.megatron_cfg.freeze_vision_projection": "gymv trains every weight",
    "policy.megatron_cfg.freeze_sound_encoder": "gymv trains every weight (no audio reaches the sound encoder)",
    "policy.megatron_cfg.freeze_sound_projection": "gymv trains every weight (no audio reaches the sound encoder)",
    "policy.generation.top_k": "gymv samples from the whole vocabulary",
    "policy.generation.stop_token_ids": "a turn ends at the end-of-turn token or one of generation.stop_strings",
    "policy.generation.val_temperature": "gymv validates greedily",
    "policy.generation.val_top_p": "gymv validates greedily",
    "policy.generation.val_top_k": "gymv validates greedily",
    "policy.generation.bad_words": "gymv never samples the image tokens, and bans nothing else",
    "policy.generation.refit_cfg": "NIXL refit settings; gymv's transports are refit.transport",
    "policy.generation.real_quant_export_cpu_offload": "gymv exports no quantised weights",
    "policy.generation.port_range_low": "gymv's engines pick their own ports",
    "policy.generation.port_range_high": "gymv's engines pick their own ports",
    "policy.generation.mcore_generation_config": "Megatron-core's generation engine; gymv generates with "
                                                 "generation.backend hf or vllm",
    "policy.generation.vllm_cfg": "a vLLM setting gymv chooses itself (docs/vllm.md)",
    "policy.generation.vllm_cfg.http_server_serving_chat_kwargs": "gymv renders every turn with the checkpoint's "
                                                                  "chat template and generation.chat_template_kwargs",
    "policy.generation.vllm_cfg.reasoning_parser_plugin": "gymv's loop splits <think> blocks off a turn itself",
    # env, data
    "env.should_mask_flagged_samples": "gymv's built-in environments flag no sample (a failed episode leaves the "
                                       "loss)",
    "env.nemo_gym": "a NeMo Gym server setting; gymv runs its built-in environments (env.name) or NeMo Gym's agent "
                    "servers (rollout.driver nemo_gym_agents, rollout.agents)",
    "env.math": "NeMo RL's own environment; gymv's environments are named by env.name",
    "env.clevr-cogent": "NeMo RL's own environment; gymv's environments are named by env.name",
    "env.geometry3k": "NeMo RL's own environment; gymv's environments are named by env.name",
    "env.refcoco": "NeMo RL's own environment; gymv's environments are named by env.name",
    "data.train.dataset_name": "gymv reads NeMo Gym JSONL rows from data.train and data.eval",
    "data.train.split": "gymv reads NeMo Gym JSONL rows from data.train and data.eval",
    "data.train.seed": "gymv reads NeMo Gym JSONL rows from data.train and data.eval",
    "data.train.split_validation_size": "gymv reads NeMo Gym JSONL rows from data.train and data.eval",
    "data.validation": "gymv reads its validation rows from data.eval",
    "data.default": "gymv reads NeMo Gym JSONL rows as they are, with no prompt file or processor",
    "data.num_workers": "gymv reads the rows in its driver",
    "data.use_multiple_dataloader": "gymv reads the rows in its driver",
    "data_plane": "gymv moves rollouts through Ray",
    # logger, cluster
    "logger.log_dir": "gymv logs into the run directory (checkpoint.dir/<name>)",
    "logger.num_val_samples_to_print": "gymv writes every validation rollout to the run directory",
    "logger.tensorboard": "NeMo RL's TensorBoard options; gymv's logger.tensorboard is the switch (NeMo RL's "
                          "logger.tensorboard_enabled)",
    "logger.wandb": "gymv's W&B keys are logger.wandb (the switch) and logger.wandb_project",
    "logger.mlflow": "a logger plugin's own settings (logger.plugins)",
    "logger.swanlab": "a logger plugin's own settings (logger.plugins)",
    "logger.monitor_gpus": "gymv does not log GPU utilisation",
    "logger.gpu_monitoring": "gymv does not log GPU utilisation",
    "cluster.master_port_range_low": "gymv's ranks pick their own ports",
    "cluster.master_port_range_high": "gymv's ranks pick their own ports",
    "cluster.segment_size": "gymv places roles by cluster.placement",
    # on-policy distillation
    "on_policy_distillation.deduplicate_shared_teacher_checkpoints": "gymv loads each teacher alias's checkpoint once",
    "on_policy_distillation.non_colocated_teachers": "a teacher's settings are mopd.teachers.<alias> (placement, "
                                                     "gpus, tensor_parallel_size, expert_parallel_size)",
}

SECTIONS: dict[str, str] = {
    "loss_fn": "`grpo.loss` and `grpo.importance_sampling` (MOPD: `mopd.loss` and `mopd.importance_sampling`)",
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


_PATTERNS = [k for k in (*KEYS, *NO_KEY) if "<alias>" in k]


def _entry(key: str) -> str | None:
    """The KEYS or NO_KEY entry written for NeMo RL's `key` itself (a `<alias>` segment matching any name)."""
    if key in KEYS or key in NO_KEY:
        return key
    parts = key.split(".")
    return next((p for p in _PATTERNS if len(p.split(".")) == len(parts)
                 and all(a in ("<alias>", b) for a, b in zip(p.split("."), parts))), None)


def _nearest(leaf: tuple) -> tuple[tuple, str] | tuple[None, None]:
    """(the start of `leaf` the tables have an entry for, that entry), the longest such start first."""
    for i in range(len(leaf), 0, -1):
        entry = _entry(".".join(leaf[:i]))
        if entry:
            return leaf[:i], entry
    return None, None


def _known(leaf: tuple) -> tuple:
    """The NeMo RL key of KEYS that `leaf` is, or is an entry of (a mapping-valued key: vllm_kwargs); else `leaf`
    itself (a key under a NO_KEY section keeps its own name)."""
    start, entry = _nearest(leaf)
    return start if entry in KEYS else leaf


def nemo_rl_names(path: tuple, value: Any, section: str = "grpo") -> list[tuple[tuple, str]]:
    """(path, fix) for each NeMo RL key at or under an unknown key `path` of a recipe of algorithm family
    `section`: its gymv name; for a NeMo RL section, also where gymv keeps its settings."""
    out = []
    for leaf in dict.fromkeys(_known(leaf) for leaf in _leaves(path, value)):
        nemo = ".".join(leaf)
        _, entry = _nearest(leaf)
        # a key gymv spells the same way is unknown for another reason (a section of another algorithm):
        # "gymv's name is the same name" would be no help
        if entry in KEYS and _gymv_name(KEYS[entry], section)[0] != nemo:
            out.append((leaf, f"`{nemo}` is NeMo RL's name: gymv's is {_in_section(KEYS[entry], section)} "
                              "(docs/nemo-rl.md)"))
        elif entry in NO_KEY:
            out.append((leaf, f"`{nemo}` is NeMo RL's; gymv has no counterpart: {NO_KEY[entry]} (docs/nemo-rl.md)"))
    key = ".".join(path)
    if key in SECTIONS:
        out.append((path, f"`{key}` is NeMo RL's section: gymv keeps its settings in {SECTIONS[key]} "
                          "(docs/nemo-rl.md)"))
    return out


def override_hint(key: str, algorithm: str | None) -> str | None:
    """The fix for a command-line override of NeMo RL's key `key`, or None when it is not one."""
    key = ".".join(_known(tuple(key.split("."))))
    if _nearest(tuple(key.split(".")))[1] is None:
        return None
    names = nemo_rl_names(tuple(key.split(".")), None, base_algorithm(str(algorithm or "grpo")))
    return names[0][1] if names else None
