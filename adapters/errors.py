"""The one exception a tenant sees when an adapter is refused.

Codes, by where the problem lies:
  upload      source_missing unsupported_source pickle_file config_missing weights_missing multiple_adapters
  archive     archive_unsafe_path archive_link archive_special_file archive_duplicate_member
              archive_too_many_members archive_too_large archive_compression_ratio archive_corrupt
  config      config_invalid_json config_invalid config_too_complex not_lora unsupported_task
              dora_unsupported modules_to_save_unsupported embedding_unsupported lm_head_unsupported
              fan_in_fan_out_unsupported bias_unsupported unsupported_option unsupported_module
              no_target_modules module_conflict
  weights     safetensors_truncated safetensors_header_too_large safetensors_invalid dtype_unsupported
              tensor_unknown tensor_missing tensor_unpaired tensor_duplicate tensor_shape rank_too_large
              tensor_not_finite
  base model  unsupported_base_model
  store       canonical_corrupt (a canonical folder that no longer matches its checksums or its digest: bytes that
              changed after it was stored), digest_mismatch (one whose sidecar names another digest than the one
              it was registered by)
"""


class AdapterError(ValueError):
    """An adapter that Quilt refuses, with a short machine-readable `code` and a message for the tenant."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"AdapterError({self.code!r}, {self.message!r})"
