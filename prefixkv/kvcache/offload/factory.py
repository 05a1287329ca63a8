"""Builds the KV tier behind the pool an EngineConfig names: a directory on disk or host RAM (local), a shared store
(remote), the local one in front of the store when both are named, or none."""

from __future__ import annotations

from prefixkv.config import EngineConfig
from prefixkv.kvcache.offload.host_tier import HostTier
from prefixkv.kvcache.offload.tier import KVTier, TierManifest


def create_kv_tier(config: EngineConfig, manifest: TierManifest) -> KVTier | None:
    """The tier for config.kv_offload_dir (disk) or config.kv_offload_host_size (RAM), and config.kv_remote (a
    Redis store) behind it; None when none is set. A disk directory written for another manifest is refused
    (ValueError) or ignored, as kv_offload_on_mismatch says."""
    local = _local_tier(config, manifest)
    if config.kv_remote is None:
        return local
    from prefixkv.kvcache.offload.remote_tier import RedisTier

    store = RedisTier(config.kv_remote, manifest, config.kv_remote_timeout)
    if local is None:
        return store
    from prefixkv.kvcache.offload.chained_tier import ChainedTier

    return ChainedTier(local, store)


def _local_tier(config: EngineConfig, manifest: TierManifest) -> KVTier | None:
    if config.kv_offload_host_size is not None:
        return HostTier(config.kv_offload_host_size, manifest)
    if config.kv_offload_dir is not None:
        from prefixkv.kvcache.offload.disk_tier import DiskTier

        if config.kv_offload_on_mismatch == "ignore":  # the config has checked it is one of the two
            return DiskTier(config.kv_offload_dir, config.kv_offload_size, manifest, "ignore")
        return DiskTier(config.kv_offload_dir, config.kv_offload_size, manifest, "refuse")
    return None
