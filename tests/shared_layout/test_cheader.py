"""The generated C header agrees with Python, byte for byte, checked by gcc (and nvcc)."""
import shutil
import subprocess

import pytest

from shared_layout import HEADER, SLOT, RingGeometry, cheader
from shared_layout.states import TRANSITIONS, Side, SlotState

INCLUDE = cheader.HEADER_PATH.parent


def test_committed_header_is_current():
    assert cheader.HEADER_PATH.read_text() == cheader.render(), "run: python -m shared_layout.cheader"


def _program(geoms) -> str:
    lines = ['#include <stdio.h>', '#include "blink_ring_layout.h"', "int main(void) {"]
    for rec in (HEADER, SLOT):
        lines.append(f'printf("{rec.name} size %zu\\n", sizeof({rec.name}_t));')
        for f in rec.fields:
            lines.append(f'printf("{rec.name}.{f.name} %zu\\n", offsetof({rec.name}_t, {f.name}));')
    for g in geoms:
        lines.append(f"{{ blink_ring_offsets_t o = blink_ring_offsets({g.slot_count}u, {g.prompt_arena_tokens}u, "
                     f"{g.output_arena_tokens}u, {g.logprob_arena_words}u);")
        lines.append(f'printf("geom {g.slot_count} %llu %llu %llu %llu %llu\\n", (unsigned long long)o.slots, '
                     "(unsigned long long)o.prompt_arena, (unsigned long long)o.output_arena, "
                     "(unsigned long long)o.logprob_arena, (unsigned long long)o.total); }")
    for a in SlotState:
        for b in SlotState:
            for s in Side:
                lines.append(f'printf("t {int(a)} {int(b)} {int(s)} %d\\n", blink_transition_allowed({int(a)}, {int(b)}, {int(s)}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines)


def test_gcc_offsets_sizes_and_geometry_match_python(tmp_path):
    geoms = [RingGeometry(), RingGeometry(64, 12345, 999), RingGeometry(3, 1, 7, 5)]
    src = tmp_path / "probe.c"
    src.write_text(_program(geoms))
    exe = tmp_path / "probe"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", "-I", str(INCLUDE), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    want = []
    for rec in (HEADER, SLOT):
        want.append(f"{rec.name} size {rec.size}")
        want += [f"{rec.name}.{f.name} {f.offset}" for f in rec.fields]
    for g in geoms:
        want.append(f"geom {g.slot_count} {g.slots_offset} {g.prompt_arena_offset} {g.output_arena_offset} "
                    f"{g.logprob_arena_offset} {g.total_size}")
    for a in SlotState:
        for b in SlotState:
            for s in Side:
                want.append(f"t {int(a)} {int(b)} {int(s)} {int(TRANSITIONS.get((a, b)) == s)}")
    assert out == want


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_header_compiles_as_cuda_for_sm90(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text('#include "blink_ring_layout.h"\n'
                   "__global__ void k(blink_slot_t* s, int* ok) {\n"
                   "  *ok = blink_transition_allowed(s->state, BLINK_PREFILL_PROCESSING, BLINK_SIDE_BACKEND);\n}\n")
    subprocess.run(["nvcc", "-arch=sm_90", "-c", "-I", str(INCLUDE), str(src), "-o", str(tmp_path / "k.o")],
                   check=True)
