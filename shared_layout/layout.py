"""Byte layout of the ring: header, slot records and token arenas.

One field list per record is the single source of truth. From it come the
numpy structured dtypes the Python sides use (ring.py), the offsets the RDMA
transport writes at, and the C structs with static_asserts (cheader.py). The
section offsets of a ring are computed here from its geometry and stored in
the header, so device code reads them instead of recomputing them.

    [ header | slot 0 .. slot N-1 | prompt arena | output arena | logprob arena ]
      256 B    N * SLOT_SIZE        int32 words    int32 tokens   32-bit words (f32 / i32)

Every section starts on a SECTION_ALIGN boundary. A slot addresses its prompt
and its output by token offsets into the arenas; the frontend allocates those
ranges (arena.py) and the backend validates them before use.

Variable-size sampling data (logit_bias, allowed ids, bad words) rides in the
prompt arena at the slot's `extra_offset`, `extra_words(record)` words laid out as

    logit_bias ids [n_logit_bias] i32 | logit_bias values [n_logit_bias] f32
    | allowed ids [n_allowed_ids] i32 | bad words [bad_words_words]: (length, ids...)*
    | token automaton [automaton_words] (automaton.py; docs/structured_outputs.md)

A request with n choices is a group of n slots with the same prompt: the
members (group_index 1..n-1) are submitted before the leader (group_index 0),
whose state word is written last, so the daemon that sees the leader pending
sees the whole group; it prefills the prompt once and forks the members from it.

The frontend doorbell (header word `frontend_doorbell`, the frontend its only writer) moves
after every batch of submissions or cancels, written after their state words and cancel flags.
A scheduler that polls a ring far away (the CUDA scheduler over PCIe or in GPU memory) scans
the slots only when the bell or the frontend epoch moved, and now and then anyway; any new
value counts, so a restarted frontend goes on from the value it finds.

Logprobs go the other way, daemon -> frontend, in the logprob arena: one record
of `logprob_record_words(k)` words per token, where k is the slot's top count:

    [ logprob f32 | rank i32 (1 = most likely) | top ids i32 [k] | top logprobs f32 [k] ]

The record of generated token i sits at `logprobs_offset + i * stride`; the
record of prompt token j (j >= 1; token 0 has none) at
`prompt_logprobs_offset + (j - 1) * stride'`. Records are written before the
generated count that covers them; prompt records before the first token's count.
"""
from __future__ import annotations

import dataclasses

import numpy as np

MAGIC = int.from_bytes(b"BLINKRNG", "little")
LAYOUT_VERSION = 8
MAX_STOP_IDS = 8          # stop token ids carried in the slot itself
MAX_LOGPROBS = 20         # top logprobs per token at most (OpenAI's and vLLM's limit)
LOGPROBS_OFF = -1         # SlotRequest.logprobs / prompt_logprobs: none asked (the slot's flag clear)
SECTION_ALIGN = 256       # bytes; keeps arenas aligned for vector loads and RDMA
DEFAULT_SLOTS = 4096      # paper §4.2
DEFAULT_PROMPT_ARENA_TOKENS = 1 << 22
DEFAULT_OUTPUT_ARENA_TOKENS = 1 << 22

# slot flags
FLAG_IGNORE_EOS = 1 << 0
FLAG_HAS_SEED = 1 << 1
FLAG_LOGPROBS = 1 << 2          # write a logprob record per generated token
FLAG_PROMPT_LOGPROBS = 1 << 3   # write a logprob record per prompt token (after the first)

_TYPES = {  # kind -> (numpy dtype, C type, size)
    "u32": ("<u4", "uint32_t", 4),
    "i32": ("<i4", "int32_t", 4),
    "u64": ("<u8", "uint64_t", 8),
    "i64": ("<i8", "int64_t", 8),
    "f32": ("<f4", "float", 4),
}

# (name, kind, count, comment). Order is layout order; offsets follow natural
# alignment and the record is padded to a multiple of 8 bytes.
HEADER_FIELDS = [
    ("magic", "u64", 1, "MAGIC: 'BLINKRNG' little-endian"),
    ("layout_version", "u32", 1, "LAYOUT_VERSION"),
    ("slot_count", "u32", 1, "number of slot records"),
    ("slot_size", "u32", 1, "bytes per slot record"),
    ("header_size", "u32", 1, "bytes of this header (padded)"),
    ("prompt_arena_tokens", "u64", 1, "capacity of the prompt arena, int32 tokens"),
    ("output_arena_tokens", "u64", 1, "capacity of the output arena, int32 tokens"),
    ("logprob_arena_words", "u64", 1, "capacity of the logprob arena, 32-bit words"),
    ("slots_offset", "u64", 1, "byte offset of slot 0"),
    ("prompt_arena_offset", "u64", 1, "byte offset of the prompt arena"),
    ("output_arena_offset", "u64", 1, "byte offset of the output arena"),
    ("logprob_arena_offset", "u64", 1, "byte offset of the logprob arena"),
    ("total_size", "u64", 1, "bytes of the whole ring"),
    ("backend_heartbeat", "u64", 1, "bumped by the backend while it runs"),
    ("backend_heartbeat_ns", "u64", 1, "backend clock at the last beat"),
    ("backend_epoch", "u64", 1, "bumped on every daemon start"),
    ("frontend_epoch", "u64", 1, "bumped on every frontend start"),
    ("frontend_doorbell", "u64", 1, "frontend only: bumped after each batch of submissions or cancels"),
    ("backend_status", "u32", 1, "BackendStatus"),
    ("shutdown", "u32", 1, "nonzero: the backend must stop"),
    ("model_vocab_size", "u32", 1, "published by the backend before READY"),
    ("model_max_len", "u32", 1, "context length (prompt + output), published before READY"),
    ("backend_pid", "u32", 1, "daemon process id (0 on the device-only path)"),
    ("kv_blocks_total", "u32", 1, "KV cache blocks in the daemon's pool (0: not reported)"),
    ("kv_blocks_free", "u32", 1, "KV blocks free after the daemon's latest step (evictable cached ones included)"),
    ("prefix_caching", "u32", 1, "1: the daemon's scheduler shares cached KV blocks of common prefixes"),
    ("kv_blocks_cached", "u32", 1, "KV blocks holding a prefix-cache entry (held or evictable)"),
    ("prefix_hit_tokens", "u64", 1, "admitted tokens found in the prefix cache, since the daemon started"),
    ("prefix_miss_tokens", "u64", 1, "admitted tokens not found there (computed)"),
    ("prefix_hit_blocks", "u64", 1, "admitted KV blocks found in the prefix cache"),
    ("prefix_miss_blocks", "u64", 1, "admitted KV blocks not found there"),
]

SLOT_FIELDS = [
    # -- written by whichever side owns the state; state word written last --
    ("state", "u32", 1, "SlotState"),
    ("cancel", "u32", 1, "frontend sets nonzero to cancel; backend only reads"),
    ("seq", "u64", 1, "request sequence number, unique per frontend epoch"),
    ("epoch", "u64", 1, "frontend_epoch of the submitting frontend"),
    # -- request: frontend writes in EMPTY, backend reads after the claim --
    ("prompt_offset", "u32", 1, "first token in the prompt arena"),
    ("prompt_len", "u32", 1, "prompt tokens"),
    ("output_offset", "u32", 1, "first token in the output arena"),
    ("max_tokens", "u32", 1, "tokens to generate at most (output capacity)"),
    ("temperature", "f32", 1, "0 = greedy"),
    ("top_p", "f32", 1, "(0, 1]"),
    ("top_k", "i32", 1, "0 = off"),
    ("flags", "u32", 1, "FLAG_IGNORE_EOS | FLAG_HAS_SEED | FLAG_LOGPROBS | FLAG_PROMPT_LOGPROBS"),
    ("seed", "u64", 1, "per-request sampling seed when FLAG_HAS_SEED"),
    ("n_stop_ids", "u32", 1, "used entries of stop_ids"),
    ("stop_ids", "i32", MAX_STOP_IDS, "extra token ids that end the request"),
    ("presence_penalty", "f32", 1, "[-2, 2], 0 = off"),
    ("frequency_penalty", "f32", 1, "[-2, 2], 0 = off"),
    ("repetition_penalty", "f32", 1, "(0, 2]; 0 or 1 = off"),
    ("min_p", "f32", 1, "[0, 1], 0 = off"),
    ("min_tokens", "u32", 1, "EOS and stop ids masked until this many tokens"),
    ("logprobs", "u32", 1, "top entries per generated token's record (0..MAX_LOGPROBS) with FLAG_LOGPROBS"),
    ("prompt_logprobs", "u32", 1, "top entries per prompt token's record with FLAG_PROMPT_LOGPROBS"),
    ("logprobs_offset", "u32", 1, "first word of the generated tokens' records in the logprob arena"),
    ("prompt_logprobs_offset", "u32", 1, "first word of the prompt tokens' records in the logprob arena"),
    ("extra_offset", "u32", 1, "first word of the variable sampling data in the prompt arena"),
    ("n_logit_bias", "u32", 1, "logit_bias pairs at extra_offset"),
    ("n_allowed_ids", "u32", 1, "allowed token ids after the logit_bias pairs (0 = all allowed)"),
    ("bad_words_words", "u32", 1, "words of (length, ids...) bad-word sequences after the allowed ids"),
    ("automaton_words", "u32", 1, "words of the structured-output token automaton after the bad words (0 = none)"),
    ("group_size", "u32", 1, "choices of one prompt (n): the slots of a group share its prefill; 0 or 1 = alone"),
    ("group_index", "u32", 1, "this slot's choice in its group; 0 = the leader, written after the others"),
    ("group_seq", "u64", 1, "seq of the group's leader (every member, the leader included)"),
    ("priority", "i32", 1, "scheduling priority, lower runs first (vLLM's meaning); 0 = default"),
    ("ttft_slo_ms", "u32", 1, "time-to-first-token target in ms; 0 = the daemon's default"),
    ("tbt_slo_ms", "u32", 1, "time-between-tokens target in ms; 0 = the daemon's default"),
    ("_sched_pad", "u32", 1, "zero; keeps the 8-byte alignment"),
    # -- progress: backend writes; tokens first, generated count after --
    ("generated", "u32", 1, "tokens published in the output arena"),
    ("finish_reason", "u32", 1, "FinishReason, valid in DECODE_COMPLETED"),
    ("error_code", "u32", 1, "ErrorCode, valid in DECODE_COMPLETED"),
    ("t_submit_ns", "u64", 1, "frontend clock at submit"),
    ("t_picked_ns", "u64", 1, "backend clock at the claim"),
    ("t_first_ns", "u64", 1, "backend clock at the first token"),
    ("t_last_ns", "u64", 1, "backend clock at the latest token"),
]


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: str
    count: int
    offset: int
    comment: str

    @property
    def size(self) -> int:
        return _TYPES[self.kind][2] * self.count


@dataclasses.dataclass(frozen=True)
class Record:
    """A fixed-size struct: fields with their offsets, padded size, numpy dtype."""
    name: str
    fields: tuple[Field, ...]
    size: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype({
            "names": [f.name for f in self.fields],
            "formats": [(_TYPES[f.kind][0], (f.count,)) if f.count > 1 else _TYPES[f.kind][0]
                        for f in self.fields],
            "offsets": [f.offset for f in self.fields],
            "itemsize": self.size,
        })

    def offset(self, name: str) -> int:
        return self.field(name).offset

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)


def _record(name: str, spec, pad_to: int) -> Record:
    fields, off = [], 0
    for fname, kind, count, comment in spec:
        size = _TYPES[kind][2]
        off = _align(off, size)
        fields.append(Field(fname, kind, count, off, comment))
        off += size * count
    return Record(name, tuple(fields), _align(off, pad_to))


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


HEADER = _record("blink_ring_header", HEADER_FIELDS, SECTION_ALIGN)
SLOT = _record("blink_slot", SLOT_FIELDS, 8)
HEADER_DTYPE = HEADER.dtype
SLOT_DTYPE = SLOT.dtype
TOKEN_DTYPE = np.dtype("<i4")
WORD_BYTES = 4            # logprob arena words: float32 logprobs, int32 ids and ranks


def logprob_record_words(k: int) -> int:
    """Words of one token's logprob record with k top entries (see the module docstring)."""
    return 2 + 2 * k


def decode_logprob_records(words: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[N * (2 + 2k)] record words -> (logprob [N] f32, rank [N] i32, top ids [N, k] i32,
    top logprobs [N, k] f32), most likely first."""
    w = np.ascontiguousarray(words, "<i4").reshape(-1, logprob_record_words(k))
    return (w[:, 0].copy().view("<f4"), w[:, 1].copy(), w[:, 2:2 + k].copy(),
            np.ascontiguousarray(w[:, 2 + k:]).view("<f4"))


def extra_words(n_logit_bias: int, n_allowed_ids: int, bad_words_words: int, automaton_words: int = 0) -> int:
    """Words of a slot's variable sampling data in the prompt arena."""
    return 2 * n_logit_bias + n_allowed_ids + bad_words_words + automaton_words


class LayoutMismatch(ValueError):
    """An attached ring does not match what this side was built for."""


@dataclasses.dataclass(frozen=True)
class RingGeometry:
    """The parameters of a ring; everything else is derived."""
    slot_count: int = DEFAULT_SLOTS
    prompt_arena_tokens: int = DEFAULT_PROMPT_ARENA_TOKENS
    output_arena_tokens: int = DEFAULT_OUTPUT_ARENA_TOKENS
    logprob_arena_words: int = 0     # 0: as many words as the output arena has tokens

    def __post_init__(self):
        if self.logprob_arena_words == 0 and isinstance(self.output_arena_tokens, int):
            object.__setattr__(self, "logprob_arena_words", self.output_arena_tokens)
        for name in ("slot_count", "prompt_arena_tokens", "output_arena_tokens", "logprob_arena_words"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.slot_count >= 1 << 31 or max(self.prompt_arena_tokens, self.output_arena_tokens,
                                             self.logprob_arena_words) >= 1 << 32:
            raise ValueError("ring geometry too large for 32-bit slot fields")

    @property
    def slots_offset(self) -> int:
        return HEADER.size

    @property
    def prompt_arena_offset(self) -> int:
        return _align(self.slots_offset + self.slot_count * SLOT.size, SECTION_ALIGN)

    @property
    def output_arena_offset(self) -> int:
        return _align(self.prompt_arena_offset + self.prompt_arena_tokens * TOKEN_DTYPE.itemsize,
                      SECTION_ALIGN)

    @property
    def logprob_arena_offset(self) -> int:
        return _align(self.output_arena_offset + self.output_arena_tokens * TOKEN_DTYPE.itemsize,
                      SECTION_ALIGN)

    @property
    def total_size(self) -> int:
        return _align(self.logprob_arena_offset + self.logprob_arena_words * WORD_BYTES, SECTION_ALIGN)

    def slot_offset(self, slot: int) -> int:
        """Byte offset of slot record `slot`."""
        return self.slots_offset + slot * SLOT.size

    def slot_field_offset(self, slot: int, name: str) -> int:
        return self.slot_offset(slot) + SLOT.offset(name)

    def prompt_token_offset(self, token_index: int) -> int:
        return self.prompt_arena_offset + token_index * TOKEN_DTYPE.itemsize

    def output_token_offset(self, token_index: int) -> int:
        return self.output_arena_offset + token_index * TOKEN_DTYPE.itemsize

    def logprob_word_offset(self, word_index: int) -> int:
        return self.logprob_arena_offset + word_index * WORD_BYTES

    def header_values(self) -> dict[str, int]:
        """The geometry words a ring header must carry."""
        return {
            "magic": MAGIC, "layout_version": LAYOUT_VERSION,
            "slot_count": self.slot_count, "slot_size": SLOT.size, "header_size": HEADER.size,
            "prompt_arena_tokens": self.prompt_arena_tokens,
            "output_arena_tokens": self.output_arena_tokens,
            "logprob_arena_words": self.logprob_arena_words,
            "slots_offset": self.slots_offset,
            "prompt_arena_offset": self.prompt_arena_offset,
            "output_arena_offset": self.output_arena_offset,
            "logprob_arena_offset": self.logprob_arena_offset,
            "total_size": self.total_size,
        }

    @classmethod
    def from_header(cls, header: np.void | bytes, expected: "RingGeometry | None" = None) -> "RingGeometry":
        """Validate a header and return its geometry; LayoutMismatch names the first mismatch."""
        if isinstance(header, (bytes, bytearray, memoryview)):
            if len(header) < HEADER.size:
                raise LayoutMismatch(f"ring is {len(header)} bytes, smaller than its {HEADER.size}-byte header")
            header = np.frombuffer(header, HEADER_DTYPE, count=1)[0]
        magic = int(header["magic"])
        if magic != MAGIC:
            raise LayoutMismatch(f"bad ring magic {magic:#018x} (expected {MAGIC:#018x}): not a BLINK ring")
        version = int(header["layout_version"])
        if version != LAYOUT_VERSION:
            raise LayoutMismatch(f"ring layout version {version}, this build speaks {LAYOUT_VERSION}")
        for name, want in (("slot_size", SLOT.size), ("header_size", HEADER.size)):
            got = int(header[name])
            if got != want:
                raise LayoutMismatch(f"ring {name} is {got} bytes, this build expects {want}")
        try:
            geom = cls(int(header["slot_count"]), int(header["prompt_arena_tokens"]),
                       int(header["output_arena_tokens"]), int(header["logprob_arena_words"]))
        except ValueError as e:
            raise LayoutMismatch(f"ring header geometry invalid: {e}") from None
        for name, want in geom.header_values().items():
            got = int(header[name])
            if got != want:
                raise LayoutMismatch(f"ring header {name} is {got}, its geometry implies {want}")
        if expected is not None:
            for name in ("slot_count", "prompt_arena_tokens", "output_arena_tokens", "logprob_arena_words"):
                got, want = getattr(geom, name), getattr(expected, name)
                if got != want:
                    raise LayoutMismatch(f"ring {name} is {got}, expected {want}")
        return geom
