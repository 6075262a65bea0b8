"""Recipe configuration: YAML with `defaults:` inheritance, overrides, `${...}` interpolation, schema, rules.

    from gymv.config import load_recipe
    rec = load_recipe("recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", ["grpo.max_steps=3"])
    rec.validated.grpo.max_steps, rec.origin("grpo.max_steps")
"""

from gymv.config.compat import RULES, check_compatibility
from gymv.config.exemplars import (
    check_inherits_exemplar,
    EXEMPLARS,
    default_recipes_root,
    exemplar_path,
    exemplar_paths,
    find_recipes_root,
    is_exemplar,
    recipe_files,
)
from gymv.findings import Finding
from gymv.config.inherit import compose, merge
from gymv.config.interpolate import RESOLVERS, resolve
from gymv.config.loader import LoadedRecipe, load_config, load_recipe, resolved_dict
from gymv.config.minimality import check_minimal, redundant_leaves
from gymv.config.naming import RecipeName, check_recipe_name, parse_recipe_name
from gymv.config.overrides import Override, apply_overrides, parse_override, smoke_overrides
from gymv.config.schema import ALGORITHMS, MODELS, RecipeBase, RecipeConfig, base_algorithm, is_vlm
from gymv.config.suites import suite_accounting
from gymv.config.tree import ConfigTree
from gymv.config.validate import schema_findings, schema_keys, validate_config
from gymv.yamlfile import Origin

__all__ = [
    "ALGORITHMS", "EXEMPLARS", "MODELS", "RESOLVERS", "RULES",
    "ConfigTree", "Finding", "LoadedRecipe", "Origin", "Override", "RecipeBase", "RecipeConfig", "RecipeName",
    "apply_overrides", "base_algorithm", "check_compatibility", "check_inherits_exemplar", "check_minimal", "check_recipe_name", "compose",
    "default_recipes_root", "exemplar_path", "exemplar_paths", "find_recipes_root", "is_exemplar",
    "is_vlm", "load_config", "load_recipe", "merge", "parse_override", "parse_recipe_name", 
    "recipe_files", "redundant_leaves", "resolve",
    "resolved_dict", "schema_findings", "schema_keys", "smoke_overrides", "suite_accounting", "validate_config",
]
