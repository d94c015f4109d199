"""Recipe names -> build functions. Recipes are imported lazily so a missing optional
dependency of one recipe never breaks another."""

from __future__ import annotations

import importlib

from ignition.catalog.parallel import SHARDABLE_RECIPES
from ignition.recipes.base import ExportOptions, RecipeBuild, RecipeError

RECIPES = {
    "toy": "ignition.recipes.toy",
    "qwen3": "ignition.recipes.llama",
    "llama": "ignition.recipes.llama",
    "qwen3_moe": "ignition.recipes.llama",
    "deepseek_v3": "ignition.recipes.deepseek_v3",
    "gemma3": "ignition.recipes.gemma3",
    "qwen3_5": "ignition.recipes.qwen3_5",
    "gpt_oss": "ignition.recipes.gpt_oss",
    "deepseek_v4": "ignition.recipes.deepseek_v4_export",
}


def build_recipe(options: ExportOptions) -> RecipeBuild:
    module_name = RECIPES.get(options.recipe)
    if module_name is None:
        raise RecipeError(f"unknown recipe {options.recipe!r}; available: {', '.join(sorted(RECIPES))}")
    if options.tensor_parallel > 1 and options.recipe not in SHARDABLE_RECIPES:
        raise RecipeError(f"--tensor-parallel {options.tensor_parallel}: recipe {options.recipe} has no sharded "
                          f"layout; tensor parallelism supports {', '.join(SHARDABLE_RECIPES)}")
    return importlib.import_module(module_name).build(options)
