"""The run-config: one frozen dataclass per concern, every key with its default, meaning and check.

``sections.py`` declares the keys (:func:`~fedapp.config.keys.setting` fields), ``schema.py`` reads them into
:data:`SCHEMA`, ``run_config.py`` resolves and validates a run's values into a :class:`RunConfig` once per
process, and ``docs.py`` generates docs/config.md. ``tests/unit/fedapp/config/test_config.py`` checks that
``pyproject.toml`` and the schema agree key by key.
"""

from fedapp.config.docs import CONFIG_DOC, TABLE_END, TABLE_START, doc_with_table, markdown_table
from fedapp.config.keys import DATASETS, PARTITIONERS, PRIVACY_DISTS, Key, check_value, parse_int_list
from fedapp.config.run_config import (
    RunConfig,
    check_fault_config,
    check_federation_size,
    check_secure_sum,
    clear_cache,
    ignored_keys,
    resolve_config,
    unused_keys,
    validate_cross_fields,
)
from fedapp.config.schema import SCHEMA
from fedapp.config.sections import (
    ClientDPConfig,
    DataConfig,
    DeploymentConfig,
    DP2FedSAMConfig,
    GeneralConfig,
    RobustHDPConfig,
    SoteriaFLConfig,
    TrainingConfig,
)
from strategies.errors import ConfigError

__all__ = [
    "CONFIG_DOC", "DATASETS", "PARTITIONERS", "PRIVACY_DISTS", "SCHEMA", "TABLE_END",
    "TABLE_START", "ClientDPConfig", "ConfigError", "DP2FedSAMConfig", "DataConfig", "DeploymentConfig",
    "GeneralConfig", "Key", "RobustHDPConfig", "RunConfig", "SoteriaFLConfig", "TrainingConfig", "check_fault_config",
    "check_federation_size",
    "check_secure_sum", "check_value", "clear_cache", "doc_with_table", "ignored_keys", "markdown_table",
    "parse_int_list", "resolve_config", "unused_keys", "validate_cross_fields",
]
