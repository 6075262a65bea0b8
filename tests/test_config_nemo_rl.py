"""A recipe ported from NeMo RL: each NeMo RL key the loader or `gymv lint` meets is refused with gymv's name
for it, at its line; the key table names only keys gymv has, and docs/nemo-rl.md lists every entry."""

from __future__ import annotations

import textwrap

import pytest

from gymv.config import load_recipe
from gymv.config.lint import lint_paths
from gymv.config.nemo_rl import KEYS, SECTIONS
from gymv.config.schema import MODELS
from gymv.config.validate import schema_keys
from gymv.errors import GymvError
from conftest import REPO

GRPO = textwrap.dedent(f"""\
    defaults: {REPO / "recipes" / "grpo.yaml"}
    grpo:
      num_prompts_per_step: 4
    loss_fn:
      ratio_clip_min: 0.2
      use_cispo: false
    policy:
      model_name: Qwen/Qwen3-1.7B
    """)


def fixes(path) -> dict[str, tuple[int, str]]:
    return {f.message.split("`")[1]: (f.line, f.fix) for f in lint_paths([str(path)]).findings}


def test_lint_names_gymvs_key_for_each_nemo_rl_key_at_its_line(tmp_path):
    recipe = tmp_path / "ported.yaml"
    recipe.write_text(GRPO)
    got = fixes(recipe)
    assert got["grpo.num_prompts_per_step"] == (
        3, "`grpo.num_prompts_per_step` is NeMo RL's name: gymv's is `grpo.prompts_per_step` (docs/nemo-rl.md)")
    assert got["loss_fn.ratio_clip_min"][0] == 5 and "gymv's is `grpo.loss.clip_low`" in got["loss_fn.ratio_clip_min"][1]
    assert got["policy.model_name"][0] == 8 and "gymv's is `model.path`" in got["policy.model_name"][1]
    # a NeMo RL section also says where gymv keeps its settings (use_cispo has no counterpart: no line of its own)
    assert "gymv keeps its settings in `grpo.loss` and `grpo.importance_sampling`" in got["loss_fn"][1]
    assert "loss_fn.use_cispo" not in got


def test_in_a_mopd_recipe_nemo_rls_grpo_keys_point_to_the_mopd_section(tmp_path):
    recipe = tmp_path / "mopd.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        defaults: {REPO / "recipes" / "mopd.yaml"}
        grpo:
          num_prompts_per_step: 4
          seq_logprob_error_threshold: 2.0
          async_grpo:
            max_trajectory_age_steps: 1
        on_policy_distillation:
          strict_agent_name_match: true
        """))
    got = fixes(recipe)
    assert "gymv's is `mopd.prompts_per_step`" in got["grpo.num_prompts_per_step"][1]
    assert "gymv's is `mopd.seq_logprob_error_threshold`" in got["grpo.seq_logprob_error_threshold"][1]
    assert "gymv's is `mopd.async.max_trajectory_age_steps`" in got["grpo.async_grpo.max_trajectory_age_steps"][1]
    assert "gymv's is `mopd.strict_agent_name_match`" in got["on_policy_distillation.strict_agent_name_match"][1]


def test_nemo_rls_lower_truncation_bound_is_named_truncate_min_in_grpo_and_mopd(tmp_path):
    """NeMo RL's tis clamps to [truncated_importance_sampling_ratio_min, ratio]: gymv's truncate_min, not the
    icepop bound gate_low (which truncated IS ignores)."""
    for algorithm, section in (("grpo", "grpo"), ("mopd", "mopd")):
        recipe = tmp_path / f"{algorithm}.yaml"
        recipe.write_text(f"defaults: {REPO / 'recipes' / f'{algorithm}.yaml'}\n"
                          "loss_fn:\n  truncated_importance_sampling_ratio_min: 0.5\n")
        got = fixes(recipe)["loss_fn.truncated_importance_sampling_ratio_min"][1]
        assert f"gymv's is `{section}.importance_sampling.truncate_min` (icepop, seq-mask-tis: gate_low)" in got


def test_nemo_rls_seq_mask_tis_type_is_named_as_gymvs_kind(tmp_path):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes' / 'grpo.yaml'}\n"
                      "loss_fn:\n  truncated_importance_sampling_type: seq-mask-tis\n")
    got = fixes(recipe)["loss_fn.truncated_importance_sampling_type"][1]
    assert "gymv's is `grpo.importance_sampling.kind`" in got and "seq-mask-tis: seq_mask_tis" in got


def test_nemo_rls_overlong_filtering_is_gymvs_key_of_the_same_name_in_grpo_and_mopd(tmp_path):
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text(f"defaults: {REPO / 'recipes' / 'grpo.yaml'}\ngrpo:\n  overlong_filtering: true\n")
    assert load_recipe(grpo).validated.grpo.overlong_filtering is True
    mopd = tmp_path / "mopd.yaml"
    mopd.write_text(f"defaults: {REPO / 'recipes' / 'mopd.yaml'}\ngrpo:\n  overlong_filtering: true\n")
    assert "gymv's is `mopd.overlong_filtering`" in fixes(mopd)["grpo.overlong_filtering"][1]


def test_nemo_rls_multimodal_dedup_is_gymvs_vision_dedup_payloads(tmp_path):
    recipe = tmp_path / "vlm.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes' / 'vlm_grpo.yaml'}\ngrpo:\n  deduplicate_multimodal_data: true\n")
    assert fixes(recipe)["grpo.deduplicate_multimodal_data"] == (3, "`grpo.deduplicate_multimodal_data` is NeMo RL's "
                                                                   "name: gymv's is `vision.dedup_payloads` (docs/nemo-rl.md)")


@pytest.mark.parametrize("teacher", ["default_teacher_cfg", "teacher_overrides.circle_count_simple_agent"])
def test_nemo_rls_teacher_tensor_and_expert_parallel_sizes_are_each_teachers_sizes(tmp_path, teacher):
    recipe = tmp_path / "mopd.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes' / 'mopd.yaml'}\non_policy_distillation:\n  non_colocated_teachers:\n"
                      + "".join(f"    {'  ' * i}{part}:\n" for i, part in enumerate(teacher.split(".")))
                      + f"    {'  ' * len(teacher.split('.'))}tensor_model_parallel_size: 8\n"
                      + f"    {'  ' * len(teacher.split('.'))}expert_model_parallel_size: 8\n")
    got = fixes(recipe)
    prefix = f"on_policy_distillation.non_colocated_teachers.{teacher}"
    assert "gymv's is `mopd.teachers.<alias>.tensor_parallel_size`" in got[f"{prefix}.tensor_model_parallel_size"][1]
    assert "gymv's is `mopd.teachers.<alias>.expert_parallel_size`" in got[f"{prefix}.expert_model_parallel_size"][1]


def test_the_encoder_cache_reset_hint_says_gymvs_default_and_nemo_rls_and_why(tmp_path):
    recipe = tmp_path / "vlm.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes' / 'vlm_grpo.yaml'}\npolicy:\n  generation:\n    vllm_cfg:\n"
                      "      reset_encoder_cache_after_weight_update: false\n")
    fix = fixes(recipe)["policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update"][1]
    assert "gymv's is `generation.reset_encoder_cache_after_weight_update` (true in gymv's exemplars, false by NeMo " \
           "RL's default: features cached under older weights would be reused)" in fix


def test_loading_refuses_the_first_nemo_rl_key_with_gymvs_name(tmp_path):
    recipe = tmp_path / "ported.yaml"
    recipe.write_text(GRPO)
    with pytest.raises(GymvError) as e:
        load_recipe(recipe)
    assert e.value.where.endswith("ported.yaml:3") and "gymv's is `grpo.prompts_per_step`" in e.value.fix


def test_a_nemo_rl_key_on_the_command_line_is_refused_with_gymvs_name():
    with pytest.raises(GymvError) as e:
        load_recipe(REPO / "recipes" / "llm" / "grpo-tinyqwen3-1n0g-torch-arithmetic.yaml",
                    ["loss_fn.reference_policy_kl_penalty=0.0"])
    assert "gymv's is `grpo.loss.kl_coef`" in e.value.fix


def test_every_gymv_key_the_table_names_exists():
    known = set(schema_keys(MODELS["vlm_grpo"])) | set(schema_keys(MODELS["vlm_mopd"])) | {"algorithm"}
    for nemo, hint in KEYS.items():
        assert hint.split(" ")[0] in known, nemo


def test_docs_nemo_rl_md_maps_every_key_of_the_table():
    text = (REPO / "docs" / "nemo-rl.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for nemo, hint in KEYS.items():
        head, _, last = nemo.rpartition(".")
        row = next((r for r in rows if f"`{nemo}`" in r.split(" | ")[0] or
                    (f".{last}`" in r.split(" | ")[0] and head in r.split(" | ")[0])), None)
        assert row is not None, nemo
    for section in SECTIONS:
        assert f"`{section}." in text, section


@pytest.mark.parametrize("family", ["sft", "grpo", "mopd"])
def test_a_nemo_rl_hint_never_names_the_key_it_was_given(family):
    """NeMo RL and gymv share some names (grpo.val_period); such a key is unknown for another reason (a section
    of another algorithm), and "gymv's name is the same name" helps no one."""
    from gymv.config.nemo_rl import nemo_rl_names, override_hint

    for nemo in KEYS:
        for path, fix in nemo_rl_names(tuple(nemo.split(".")), None, family):
            assert f"gymv's is `{'.'.join(path)}`" not in fix, (nemo, fix)
        hint = override_hint(nemo, family)
        assert hint is None or f"gymv's is `{nemo}`" not in hint


def test_a_grpo_section_in_an_sft_recipe_is_named_as_another_algorithms_section(tmp_path):
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes' / 'sft.yaml'}\ngrpo:\n  val_period: 5\n  val_at_start: true\n")
    with pytest.raises(GymvError) as e:
        load_recipe(recipe)
    assert e.value.message.startswith("section `grpo` does not belong to algorithm sft") and "NeMo RL" not in str(e.value)
    with pytest.raises(GymvError) as e:
        load_recipe(REPO / "recipes" / "sft.yaml", ["grpo.val_period=5"])
    assert "NeMo RL" not in str(e.value) and "grpo.val_period" in str(e.value)
