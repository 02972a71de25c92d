from pathlib import Path

import pytest

from treadle_common.config.recipe import RecipeError, RunConfig, load_recipe

pytestmark = pytest.mark.unit
RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_in_the_repo_loads(recipe: Path):
    assert isinstance(load_recipe(recipe), RunConfig)


def test_recipes_exist():
    assert {p.name for p in RECIPES} >= {"skeleton.yaml", "demo.yaml"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_unknown_field_is_named(tmp_path):
    path = write(tmp_path, "model: {path: m}\ntrainer: {num_stepz: 3}\n")
    with pytest.raises(RecipeError, match=r"trainer\.num_stepz"):
        load_recipe(path)


def test_wrong_type_is_named(tmp_path):
    path = write(tmp_path, "model: {path: m}\nrollout: {group_size: many}\n")
    with pytest.raises(RecipeError, match=r"rollout\.group_size"):
        load_recipe(path)


def test_missing_model_is_named(tmp_path):
    with pytest.raises(RecipeError, match=r"model: Field required"):
        load_recipe(write(tmp_path, "scorer: exact_match\n"))


def test_set_overrides_parse_yaml_scalars(tmp_path):
    path = write(tmp_path, "model: {path: m}\n")
    cfg = load_recipe(
        path, ["trainer.lr=3e-4", "rollout.sampling.max_new_tokens=5", "env.name=countdown"]
    )
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.rollout.sampling.max_new_tokens == 5
    assert cfg.env.name == "countdown"


def test_bad_override_form(tmp_path):
    with pytest.raises(RecipeError, match="a.b=c"):
        load_recipe(write(tmp_path, "model: {path: m}\n"), ["trainer.lr"])


def test_override_of_unknown_field_fails(tmp_path):
    with pytest.raises(RecipeError, match=r"trainer\.nope"):
        load_recipe(write(tmp_path, "model: {path: m}\n"), ["trainer.nope=1"])


def test_unknown_loss_or_advantage_names_the_known_ones(tmp_path):
    path = write(tmp_path, "model: {path: m}\ntrainer: {loss: ppo2, advantage: gae}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert "trainer.loss" in str(err.value) and "'decoupled_ppo'" in str(err.value)
    assert "trainer.advantage" in str(err.value) and "'rloo'" in str(err.value)


def test_profile_steps_are_step_numbers(tmp_path):
    path = write(tmp_path, "model: {path: m}\n")
    assert load_recipe(path, ["trainer.profile_steps=[2, 5]"]).trainer.profile_steps == [2, 5]
    assert load_recipe(path).trainer.profile_steps == []  # nothing profiled by default
    with pytest.raises(RecipeError, match=r"trainer\.profile_steps\.0"):
        load_recipe(path, ["trainer.profile_steps=[0]"])
