"""Per-transfer telemetry (DESIGN.md 4.3, 8): one structured record per transfer and side,
for the metrics layer to export (`splitserve_kv_transfer_*`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum

from splitserve.transfer.transport import TransferState


class TransferSide(IntEnum):
    SENDER = 0
    RECEIVER = 1


@dataclass(slots=True)
class TransferTelemetry:
    """Sizes and stage times of one transfer, seen from one side. Times are seconds.

    The sender's record also carries the receiver's `validate_s` and `place_s`, copied from
    the receiver's reply, so one record describes the whole transfer.
    """
    transfer_id: str
    request_id: str
    transport: str  # "inproc" | "shm" | "tcp" | ...
    side: TransferSide
    compression: str = "none"
    num_layers: int = 0
    num_tokens: int = 0  # tokens in the transferred range
    payload_bytes: int = 0  # K/V bytes in the engine's dtype (before compression)
    wire_bytes: int = 0  # bytes on the wire, framing included
    pack_s: float = 0.0  # sender: copy out of the engine + encode + checksum
    queue_s: float = 0.0  # sender: layers waiting for the send thread (summed over layers)
    wire_s: float = 0.0  # sender: inside transport sends; receiver: header to trailer
    validate_s: float = 0.0  # receiver: header checks, checksums, dequantization
    place_s: float = 0.0  # receiver: write_kv_layer + commit_kv on the engine thread
    total_s: float = 0.0  # start (plan / start()) to the terminal state
    reused_channel: bool = False  # sender: on a channel kept open from an earlier transfer
    # Sender, layer-wise streaming: layers copied out inside the forward pass, wire time
    # that ran while the prefill step still computed, and the time from the end of that
    # step to the receiver's reply (what the decode side waits beyond the prefill).
    layers_during_compute: int = 0
    overlap_s: float = 0.0
    exposed_s: float = 0.0
    state: TransferState = TransferState.PENDING
    error: str | None = None  # error class name when FAILED

    @property
    def overlapped_compute(self) -> bool:
        return self.layers_during_compute > 0

    def as_record(self) -> dict[str, object]:
        """Flat, JSON/msgpack-friendly dict (enums as names)."""
        record = asdict(self)
        record["side"] = self.side.name.lower()
        record["state"] = self.state.name.lower()
        record["overlapped_compute"] = self.overlapped_compute
        return record
