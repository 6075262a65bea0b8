"""`gymv lint --fix` (fix_minimality): deletes exactly the redundant leaves, keeps everything else, is idempotent."""

from __future__ import annotations

import os
import stat

import pytest

from gymv.config import check_minimal, load_recipe
from gymv.config.lint import fix_minimality
from gymv.errors import GymvError
from lint_tree import Tree

REL = "llm/grpo-tiny-1n0g-torch.yaml"

BEFORE = """\
# tiny text GRPO on a CPU
defaults: ../grpo.yaml

seed: 42            # the exemplar's value: redundant
model:
  # the model is the exemplar's, but shorter
  max_seq_len: 512
  dtype: auto
training:
  # AdamW as in the exemplar
  betas:
    - 0.9
    - 0.999
grpo:
  max_steps: 100
  loss:
    kl_coef: 0.0    # no reference model
"""

AFTER = """\
# tiny text GRPO on a CPU
defaults: ../grpo.yaml

model:
  # the model is the exemplar's, but shorter
  max_seq_len: 512
  # AdamW as in the exemplar
grpo:
  loss:
    kl_coef: 0.0    # no reference model
"""


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Tree:
    monkeypatch.chdir(tmp_path)
    t = Tree(tmp_path)
    t.write(REL, BEFORE)
    return t


def test_fix_deletes_exactly_the_redundant_leaves_and_the_sections_they_empty(tree):
    result = fix_minimality(tree.root / REL)
    assert (tree.root / REL).read_text() == AFTER
    assert sorted(result.removed) == ["grpo.max_steps", "model.dtype", "seed", "training"]
    assert result.lines_removed == 7 and result.left == ()


def test_fix_keeps_every_whole_line_comment_and_the_layout_of_the_rest(tree):
    fix_minimality(tree.root / REL)
    comments = [line for line in BEFORE.splitlines() if line.strip().startswith("#")]
    after = (tree.root / REL).read_text().splitlines()
    assert [line for line in after if line.strip().startswith("#")] == comments
    assert all(line in BEFORE.splitlines() for line in after)


def test_fixed_recipe_loads_to_the_same_resolved_config_and_is_minimal(tree):
    before = load_recipe(tree.root / REL).resolved
    fix_minimality(tree.root / REL)
    again = load_recipe(tree.root / REL)
    assert again.resolved == before and check_minimal(again) == []


def test_fix_is_idempotent(tree):
    fix_minimality(tree.root / REL)
    once = (tree.root / REL).read_text()
    result = fix_minimality(tree.root / REL)
    assert (tree.root / REL).read_text() == once and not result.changed


def test_a_clean_recipe_is_left_byte_for_byte_alone(tree):
    path = tree.root / "vlm/vlm_grpo-tiny-1n0g-torch.yaml"
    text = path.read_text()
    assert not fix_minimality(path).changed and path.read_text() == text


def test_a_redundant_key_inside_a_flow_mapping_is_left_and_reported(tree):
    tree.write(REL, "defaults: ../grpo.yaml\nmodel: {max_seq_len: 512, dtype: auto}\nseed: 42\n")
    result = fix_minimality(tree.root / REL)
    assert result.left == ("model.dtype",) and result.removed == ("seed",)
    assert (tree.root / REL).read_text() == "defaults: ../grpo.yaml\nmodel: {max_seq_len: 512, dtype: auto}\n"


def test_a_flow_mapping_that_is_entirely_redundant_goes_as_one_line(tree):
    tree.write(REL, "defaults: ../grpo.yaml\nmodel: {dtype: auto}\nseed: 7\n")
    assert fix_minimality(tree.root / REL).removed == ("model",)
    assert (tree.root / REL).read_text() == "defaults: ../grpo.yaml\nseed: 7\n"


def test_fix_keeps_the_file_mode(tree):
    path = tree.root / REL
    os.chmod(path, 0o640)
    fix_minimality(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_fix_that_would_break_the_file_is_undone_with_an_error(tree):
    text = "defaults: ../grpo.yaml\nseed: &s 42\ngrpo:\n  val_period: *s\n"
    tree.write(REL, text)
    with pytest.raises(GymvError, match="file is unchanged"):
        fix_minimality(tree.root / REL)
    assert (tree.root / REL).read_text() == text
