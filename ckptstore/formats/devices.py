"""Where a checkout may put tensors: a device torch can use here, checked before any work."""

from __future__ import annotations

from ckptstore.errors import DeviceUnavailableError


def check_device(device: str | None) -> None:
    """Refuse, before any work, a device torch cannot use here (no CUDA build or GPU, no such index)."""
    if device is None:
        return
    import torch

    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceUnavailableError(f"map_location {device!r} is not a device torch knows: {exc}") from None
    if target.type in ("cpu", "meta"):
        return
    try:  # torch's lazy submodules raise ModuleNotFoundError for a backend it has no module of (hpu)
        backend = torch.backends.mps if target.type == "mps" else getattr(torch, target.type, None)
    except ImportError:
        backend = None
    is_available = getattr(backend, "is_available", None)
    if is_available is None:  # a backend with no is_available (xla, mkldnn): ask it for a tensor
        try:
            torch.empty(0, device=target)
        except Exception as exc:  # torch's own for each (NotImplementedError, RuntimeError of an internal assert)
            raise DeviceUnavailableError(f"cannot load onto {device!r}: torch {torch.__version__} here cannot make "
                                         f"a tensor there ({str(exc).splitlines()[0][:120]}); use map_location='cpu'"
                                         ) from None
        return
    if not is_available():
        raise DeviceUnavailableError(
            f"cannot load onto {device!r}: this machine has no usable {target.type} device for torch "
            f"{torch.__version__} (torch.{target.type}.is_available() is False); use map_location='cpu'")
    count = getattr(backend, "device_count", None)
    if target.index is not None and count is not None and target.index >= count():
        raise DeviceUnavailableError(f"cannot load onto {device!r}: this machine has {count()} {target.type} "
                                     f"device(s), numbered from 0")
