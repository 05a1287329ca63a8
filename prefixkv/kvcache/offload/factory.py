"""Builds the second KV tier an EngineConfig names (a directory on disk, or host RAM), or none."""

from __future__ import annotations

from prefixkv.config import EngineConfig
from prefixkv.kvcache.offload.host_tier import HostTier
from prefixkv.kvcache.offload.tier import KVTier, TierManifest


def create_kv_tier(config: EngineConfig, manifest: TierManifest) -> KVTier | None:
    """The tier for config.kv_offload_dir (disk) or config.kv_offload_host_size (RAM); None when neither is set.
    A disk directory written for another manifest is refused (ValueError) or ignored, as kv_offload_on_mismatch
    says."""
    if config.kv_offload_host_size is not None:
        return HostTier(config.kv_offload_host_size, manifest)
    if config.kv_offload_dir is not None:
        from prefixkv.kvcache.offload.disk_tier import DiskTier

        if config.kv_offload_on_mismatch == "ignore":  # the config has checked it is one of the two
            return DiskTier(config.kv_offload_dir, config.kv_offload_size, manifest, "ignore")
        return DiskTier(config.kv_offload_dir, config.kv_offload_size, manifest, "refuse")
    return None
