"""The shipped mappings, one YAML file per config.model_type (installed as tpmap/mappings/*.yaml)."""
