"""What the methods that draft with other methods (`hybrid`, `switch`) share: their sources built from speculative
configs and checked alike, what the engine reads of them (the target features one of them may need, the
observations they want), and the hooks forwarded to every source."""
from __future__ import annotations

from specdec.config import SpecdecError
from specdec.drafting.base import DraftEnv, Drafter, DraftRequest
from specdec.drafting.registry import SpeculativeConfig


def build_sources(cfg: SpeculativeConfig, env: DraftEnv | None) -> list[tuple[Drafter, SpeculativeConfig]]:
    """The drafters of `cfg.options.sources`, each refused by name where method `cfg.method` cannot nest it: under
    tensor parallelism where it runs the target's layers, a dynamic tree, more tokens than `cfg`'s k."""
    sources = []
    for src in cfg.options.sources:
        sub = SpeculativeConfig.parse(src)
        if env is not None:
            sub.info.check_tensor_parallel(env.tensor_parallel_size)
        if sub.shape.dynamic:
            raise SpecdecError(f"{cfg.method} source {sub.method!r}: dynamic trees cannot be nested; give a chain or "
                               "a static tree")
        if sub.num_draft_tokens > cfg.num_speculative_tokens:
            raise SpecdecError(f"{cfg.method} source {sub.method!r} drafts up to {sub.num_draft_tokens} tokens, more "
                               f"than the {cfg.method}'s num_speculative_tokens={cfg.num_speculative_tokens}")
        sources.append((sub.info.build(sub, env), sub))
    return sources


class NestedDrafter(Drafter):
    """A drafter over `drafters` (its sources, in order): at most one reads the target's features (`featured`),
    none needs the target's guess after each of its own nodes (lookahead's Jacobi window, which a step that may
    verify another source's draft cannot give)."""

    def nest(self, drafters: list[Drafter], method: str) -> None:
        if any(d.observe_drafts for d in drafters):
            raise SpecdecError(f"a {method} does not take 'lookahead': its Jacobi window needs the target's guess "
                               "after each of its own nodes at every step")
        featured = [n for n, d in enumerate(drafters) if d.feature_layers]
        if len(featured) > 1:
            raise SpecdecError(f"a {method} takes at most one source that reads the target's features")
        self.drafters = drafters
        self.featured_index = featured[0] if featured else None
        head = drafters[featured[0]] if featured else None
        self.feature_layers = tuple(head.feature_layers) if head else ()
        self.reloads_head = head is not None and head.reloads_head
        self.observe_topk = max(d.observe_topk for d in drafters)
        self.cache_reads_next_token = any(d.cache_reads_next_token for d in drafters)

    @property
    def head_path(self) -> str | None:
        return self.drafters[self.featured_index].head_path if self.featured_index is not None else None

    def reload_head(self, path: str) -> None:
        if not self.reloads_head:
            super().reload_head(path)
        self.drafters[self.featured_index].reload_head(path)

    def forget(self) -> None:
        for d in self.drafters:
            d.forget()

    def release(self, seq_id: int) -> None:
        for d in self.drafters:
            d.release(seq_id)

    def observe(self, seq_id: int, tokens: list[int], candidates: list[list[int]]) -> None:
        for d in self.drafters:
            if d.observe_topk:
                d.observe(seq_id, tokens, [c[:d.observe_topk] for c in candidates])

    @property
    def keeps_kv(self) -> bool:
        return any(d.keeps_kv for d in self.drafters)

    def cached_prefix(self, request: DraftRequest) -> int | None:
        found = [n for n in (d.cached_prefix(request) for d in self.drafters) if n is not None]
        return min(found) if found else None
