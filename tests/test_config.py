"""The config object: frozen, validated field by field, round-trips through JSON."""

import dataclasses

import pytest

from model.config import ConfigError, EncoderConfig, from_json, to_json, variants


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EncoderConfig().d_model = 8


def test_heads_must_divide_d_model():
    with pytest.raises(ConfigError, match="n_heads=5 does not divide d_model=256"):
        EncoderConfig(n_heads=5)


@pytest.mark.parametrize("field,value", [("scaling", "cube_root"), ("attention", "flash"),
                                         ("positional", "alibi"), ("activation", "swish"),
                                         ("norm_placement", "peri"), ("ffn", "swiglu"), ("norm", "batch"),
                                         ("position_ids", "from_one")])
def test_unknown_switch_value_names_the_field_and_the_choices(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value!r} is not one of"):
        EncoderConfig(**{field: value})


def test_unknown_field_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown config field"):
        EncoderConfig().replace(n_experts=8)


@pytest.mark.parametrize("change,message", [
    (dict(local_layers=(4,)), "local_layers must be distinct layer indices in 0..3"),
    (dict(local_layers=(2, 1)), "ascending"),
    (dict(local_layers=(1,), attention="linear"), "needs attention='softmax'"),
    (dict(first_attention_norm=False), "needs norm_placement='pre'"),
    (dict(position_ids="after_padding"), "needs positional='learned'"),
    (dict(positional="rotary", d_model=12, n_heads=4), "even head_dim"),
])
def test_inconsistent_model_parts_are_refused_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        EncoderConfig(**change)


def test_attention_plan_survives_the_json_round_trip_as_a_tuple():
    config = EncoderConfig(local_layers=[1, 2], local_window=64)
    again = from_json(to_json(config))
    assert again == config and again.local_layers == (1, 2)
    assert [config.layer_window(i) for i in range(4)] == [None, 64, 64, None]


def test_json_round_trip_gives_an_equal_config():
    config = EncoderConfig(name="x", d_model=64, n_heads=8, scaling="cosine", temperature=0.5)
    assert from_json(to_json(config)) == config


def test_every_variant_changes_exactly_its_switch_from_the_default():
    base = EncoderConfig()
    for name, config in variants(base).items():
        changed = {f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(config, f.name)}
        assert len(changed - {"name"}) <= 2, (name, changed)
        assert name == "default" or changed, name


def test_variants_builds_only_the_presets_asked_for():
    sparse = EncoderConfig(head="sparse")
    assert list(variants(sparse, ["default"])) == ["default"]  # "features" cannot take a sparse head
    with pytest.raises(ConfigError, match="head='sparse' needs input_kind='tokens'"):
        variants(sparse, ["features"])
