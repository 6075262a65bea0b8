"""A recipe ported from NeMo RL: each NeMo RL key the loader or `gymv lint` meets is refused with gymv's name
for it, or why gymv has none, at its line; the key table names only keys gymv has, and docs/nemo-rl.md lists
every entry. Every key of the reference Nemotron Omni recipes (tests/nemo_rl_reference, written from NeMo RL's
files merged with their parents) is mapped, named by lint, and in docs/nemo-rl.md's parity table."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from gymv.config import load_recipe
from gymv.config.lint import lint_paths
from gymv.config.nemo_rl import KEYS, NO_KEY, SECTIONS, nemo_rl_names
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
    # a NeMo RL section also says where gymv keeps its settings; a key without a counterpart says why
    assert "gymv keeps its settings in `grpo.loss` and `grpo.importance_sampling`" in got["loss_fn"][1]
    assert got["loss_fn.use_cispo"] == (
        6, "`loss_fn.use_cispo` is NeMo RL's; gymv has no counterpart: gymv has no CISPO loss (docs/nemo-rl.md)")


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


def test_a_mapping_nemo_rl_writes_where_gymv_takes_a_value_is_named_key_by_key(tmp_path):
    recipe = tmp_path / "vlm.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes' / 'vlm_grpo.yaml'}\nlogger:\n  wandb:\n    project: p\n"
                      "data:\n  train:\n    data_path: rows.jsonl\n")
    got = fixes(recipe)
    assert got["logger.wandb.project"] == (4, "`logger.wandb.project` is NeMo RL's name: gymv's is "
                                              "`logger.wandb_project` (docs/nemo-rl.md)")
    assert got["data.train.data_path"][0] == 7 and "gymv's is `data.train`" in got["data.train.data_path"][1]
    assert not any(k.startswith("data.train.") and k != "data.train.data_path" for k in got)  # one finding a key


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


# -- the reference Nemotron Omni recipes ----------------------------------------------------------------------

REFERENCE = REPO / "tests" / "nemo_rl_reference"


def reference(name: str) -> dict:
    """One reference recipe's keys and values (dotted key -> value); the smoke's are its own over mopd-10n8g."""
    return yaml.safe_load((REFERENCE / f"{name}.yaml").read_text())


def reference_keys() -> set[str]:
    return set(reference("grpo-circle-click-2n8g")) | set(reference("mopd-10n8g")) | set(reference("mopd-4n8g-smoke"))


def nested(flat: dict) -> dict:
    """The recipe tree of dotted keys; an interpolation NeMo RL resolves becomes plain text (gymv would resolve
    it against its own keys)."""
    tree: dict = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = "interpolated" if isinstance(value, str) and "${" in value else value
    return tree


def test_the_reference_fixtures_hold_the_omni_experiments_settings():
    grpo, mopd, smoke = reference("grpo-circle-click-2n8g"), reference("mopd-10n8g"), reference("mopd-4n8g-smoke")
    assert (len(grpo), len(mopd), len(reference_keys())) == (382, 317, 433)
    assert (grpo["grpo.num_prompts_per_step"], grpo["grpo.num_generations_per_prompt"], grpo["loss_fn.ratio_clip_max"],
            grpo["grpo.seq_logprob_error_threshold"], grpo["policy.generation.max_new_tokens"]) == (1, 16, 0.28, 2, 8192)
    assert (mopd["grpo.async_grpo.enabled"], mopd["grpo.num_prompts_per_step"], mopd["policy.generation.max_new_tokens"],
            mopd["loss_fn.truncated_importance_sampling_type"]) == (True, 8, 4096, "icepop")
    assert set(smoke) <= set(mopd) and smoke["grpo.max_num_steps"] == 3


def test_every_reference_key_has_gymvs_name_or_the_reason_gymv_has_none():
    for key in sorted(reference_keys()):
        names = nemo_rl_names(tuple(key.split(".")), None, "mopd" if "distillation" in key else "grpo")
        mapped = key in ("grpo.val_period", "grpo.val_at_start", "grpo.seq_logprob_error_threshold",
                         "grpo.overlong_filtering", "cluster.num_nodes", "cluster.gpus_per_node", "data.shuffle")
        assert mapped or names, f"{key}: neither gymv's name nor why gymv has none"
        assert all("(docs/nemo-rl.md)" in fix for _, fix in names), key


@pytest.mark.parametrize("name, exemplar", [("grpo-circle-click-2n8g", "vlm_grpo"), ("mopd-10n8g", "mopd")])
def test_lint_names_a_fix_at_every_reference_key_a_gymv_recipe_cannot_take(tmp_path, name, exemplar):
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump({"defaults": str(REPO / "recipes" / f"{exemplar}.yaml"), **nested(reference(name))},
                                     sort_keys=False))
    findings = [f for f in lint_paths([str(recipe)]).findings if f.rule == "GV006"]
    named = {f.message.split("`")[1]: f.fix for f in findings}
    own = set(schema_keys(MODELS[exemplar]))
    for key in reference(name):
        parts = key.split(".")
        covering = [named[k] for k in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if k in named]
        assert key in own or covering, f"{key}: no finding"
        assert key in own or "docs/nemo-rl.md" in covering[0], (key, covering[0])


def _parity_rows() -> list[list[str]]:
    text = (REPO / "docs" / "nemo-rl.md").read_text()
    section = text.split("## The Omni reference recipes, key by key", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines()
            if line.startswith("| `")]


def _keys_of(cell: str) -> set[str]:
    """The keys a first cell names: `a.b.c` in full, then `.d` for a.b.d (relative to the last full key's parent)."""
    keys, parent = set(), ""
    for name in cell.split("`")[1::2]:
        if name.startswith("."):
            keys.add(parent + name)
        else:
            keys.add(name)
            parent = name.rpartition(".")[0]
    return keys


def test_docs_parity_table_lists_every_reference_key_with_gymvs_key_and_a_verdict():
    rows = _parity_rows()
    listed = set().union(*(_keys_of(r[0]) for r in rows))
    assert sorted(reference_keys() - listed) == []
    assert sorted(listed - reference_keys()) == []
    for row in rows:
        assert len(row) == 3 and row[1] and row[2], row
        assert row[2].split(":")[0].split(" ")[0].strip("*") in ("same", "differs", "no", "unused", "the", "as"), row


def test_nemo_rls_expert_tensor_parallel_size_is_explained_as_gymvs_whole_experts(tmp_path):
    recipe = tmp_path / "vlm.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes' / 'vlm_grpo.yaml'}\npolicy:\n  megatron_cfg:\n"
                      "    expert_tensor_parallel_size: 1\n")
    line, fix = fixes(recipe)["policy.megatron_cfg.expert_tensor_parallel_size"]
    assert line == 4 and "keeps each expert whole" in fix and "expert tensor parallel size 1" in fix
