"""Typed, validated job and scenario specs (YAML/JSON) with clear errors."""
from .errors import ConfigError
from .presets import PRESETS, ModelShape, preset
from .files import read_document, read_mapping
from .scenario import SCENARIO_KEYS, Scenario, load_scenario, validate_rates

__all__ = ["ConfigError", "PRESETS", "ModelShape", "preset", "SCENARIO_KEYS", "Scenario",
           "load_scenario", "read_document", "read_mapping", "validate_rates"]
