"""The KV store's knobs on one worker (CLI `--kv-host-bytes`, `--kv-disk-dir`,
`--kv-disk-bytes`, and YAML), checked when built. Peer fetch (`--kv-peer-fetch`) is the
router's choice (RouterConfig.peer_fetch): every worker can export what it holds."""
from __future__ import annotations

from dataclasses import dataclass

from .block import DiskAdmission


@dataclass(frozen=True)
class StoreConfig:
    host_bytes: int = 0  # host-memory tier size; 0: off
    disk_dir: str | None = None  # disk tier directory; None: off
    disk_bytes: int = 0  # disk tier size (payload bytes); required with disk_dir
    disk_admission: str = DiskAdmission.REUSED  # "reused" (DESIGN.md 6) or "all"
    tenant_quota_bytes: int | None = None  # per tenant, in each tier; None: no quota
    disk_fsync: bool = False  # fsync each block file (survives power loss; slower writes)
    disk_queue_blocks: int = 64  # blocks waiting for the disk writer before BUSY

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "disk_queue_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
        if self.disk_queue_blocks == 0:
            raise ValueError("disk_queue_blocks=0: the disk writer needs room for at least "
                             "one block")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, str) or not self.disk_dir.strip():
                raise ValueError(f"--kv-disk-dir {self.disk_dir!r} must name a directory")
            if self.disk_bytes == 0:
                raise ValueError("--kv-disk-dir needs --kv-disk-bytes (the tier's size) > 0")
        elif self.disk_bytes:
            raise ValueError(f"--kv-disk-bytes {self.disk_bytes} without --kv-disk-dir: "
                             f"name the directory the disk tier writes to")
        if self.disk_admission not in {a.value for a in DiskAdmission}:
            raise ValueError(f"disk admission {self.disk_admission!r} is not one of "
                             f"{[a.value for a in DiskAdmission]}")
        quota = self.tenant_quota_bytes
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int)
                                  or quota <= 0):
            raise ValueError(f"tenant_quota_bytes={quota!r} must be a positive integer "
                             f"(or None: no quota)")

    @property
    def enabled(self) -> bool:
        """Whether any tier below the engine pool is on."""
        return bool(self.host_bytes) or self.disk_dir is not None

    def check_block_bytes(self, block_bytes: int) -> None:
        """ValueError if a configured tier or the quota cannot hold one block."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes={block_bytes} must be positive")
        for flag, value in (("--kv-host-bytes", self.host_bytes),
                            ("--kv-disk-bytes", self.disk_bytes),
                            ("tenant quota", self.tenant_quota_bytes)):
            if value and value < block_bytes:
                raise ValueError(f"{flag} {value} is smaller than one KV block "
                                 f"({block_bytes} bytes); raise it or turn the tier off")
