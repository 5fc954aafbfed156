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
                                         ("positional", "rotary"), ("activation", "swish"),
                                         ("norm_placement", "sandwich")])
def test_unknown_switch_value_names_the_field_and_the_choices(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value!r} is not one of"):
        EncoderConfig(**{field: value})


def test_unknown_field_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown config field"):
        EncoderConfig().replace(n_experts=8)


def test_json_round_trip_gives_an_equal_config():
    config = EncoderConfig(name="x", d_model=64, n_heads=8, scaling="cosine", temperature=0.5)
    assert from_json(to_json(config)) == config


def test_every_variant_changes_exactly_its_switch_from_the_default():
    base = EncoderConfig()
    for name, config in variants(base).items():
        changed = {f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(config, f.name)}
        assert len(changed - {"name"}) <= 2, (name, changed)
        assert name == "default" or changed, name
