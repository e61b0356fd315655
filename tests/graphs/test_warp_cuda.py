"""W8A8 layers, Warp kernels and torch ops in one CUDA graph, whoever owns the capture; and what breaks one.

One step of the `Pipeline`: a float32 input (static, or copied from pinned host memory inside the graph) ->
bfloat16 (torch) -> `W8A8Linear` (quantization kernel + GEMM) -> float32 (torch) -> a Warp kernel scaling
by a device scalar -> a row max (torch). After every replay, with new inputs copied in between:

- the linear's output against the float64 reference from the dequantized operands (`cutlass_w8a8.testing.references.reference`,
  the activations quantized eagerly by the same kernel the graph ran);
- the Warp kernel's output equal, bit for bit, to ``y.float() * temp`` (one correctly rounded multiply on
  both sides), and the row max equal to the eager ``amax`` of it.

Owners: ``torch`` (``torch.cuda.graph``; the Warp kernel launched on torch's current stream) and ``warp``
(``wp.ScopedCapture`` on a Warp stream made from a torch stream; torch's allocations inside the capture go
to a ``torch.cuda.MemPool`` of their own, kept alive with the graph, so that the caching allocator never
hands the graph's memory to anything else).

Needs Warp: warp-lang 1.5.1 without its CPU compiler (CUDA kernels only), see docs/TESTING.md, "Warp";
skips cleanly without it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, reference

try:
    import warp as wp
except Exception as exc:  # noqa: BLE001 (ImportError, or a Warp whose native library fails to load)
    wp = None
    _WARP_MISSING = (f"warp is not importable ({type(exc).__name__}: {exc}); untar "
                     ".whl/warp-1.5.1-cuda-only.tar.xz and put its directory on PYTHONPATH (docs/TESTING.md, \"Warp\")")
else:
    _WARP_MISSING = ""

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(wp is None, reason=_WARP_MISSING)]

K, N = 256, 384  # multiples of 16, as W8A8Linear needs
OWNERS = ("torch", "warp")

if wp is not None:
    @wp.kernel
    def _scale(y: wp.array2d(dtype=wp.float32), t: wp.array(dtype=wp.float32), z: wp.array2d(dtype=wp.float32)):
        """``z = y * t[0]``."""
        i, j = wp.tid()
        z[i, j] = y[i, j] * t[0]


@pytest.fixture(scope="module")
def warp_device():
    """Warp initialised on torch's current CUDA device (Warp CUDA kernels only: no CPU compiler here)."""
    wp.config.quiet = True
    wp.init()
    if not wp.is_cuda_available():
        pytest.skip("Warp sees no CUDA device (driver too old for Warp 1.5.1?)")
    return wp.get_device(f"cuda:{torch.cuda.current_device()}")


def make_layer(seed: int) -> cw.W8A8Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=True, device="cuda", dtype=torch.bfloat16)
    return cw.W8A8Linear.from_float(lin).requires_grad_(False)


class Pipeline:
    """Static buffers and one step (see the module docstring). ``staged``: the step starts by copying a pinned
    host buffer into the input with ``non_blocking=True``, inside the graph."""

    def __init__(self, layer: cw.W8A8Linear, m: int, staged: bool = False):
        self.layer = layer
        self.x = torch.zeros(m, K, device="cuda")
        self.x_host = torch.zeros(m, K, pin_memory=True) if staged else None
        self.temp = torch.ones(1, device="cuda")
        self.y = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
        self.y32 = torch.empty(m, N, device="cuda")
        self.z = torch.empty(m, N, device="cuda")
        self.r = torch.empty(m, device="cuda")
        self.w_y32, self.w_temp, self.w_z = wp.from_torch(self.y32), wp.from_torch(self.temp), wp.from_torch(self.z)
        self.streams: dict[int, "wp.Stream"] = {}  # Warp handles of torch streams, made outside any capture

    def warp_stream(self, stream: torch.cuda.Stream):
        if stream.cuda_stream not in self.streams:
            assert not torch.cuda.is_current_stream_capturing(), "Warp streams are made before the capture"
            self.streams[stream.cuda_stream] = wp.stream_from_torch(stream)
        return self.streams[stream.cuda_stream]

    def step(self) -> None:
        if self.x_host is not None:
            self.x.copy_(self.x_host, non_blocking=True)  # pinned host -> device, a memcpy node of the graph
        y = self.layer(self.x.to(torch.bfloat16))        # torch op, quantization kernel, GEMM (they allocate)
        self.y.copy_(y)
        self.y32.copy_(y)
        wp.launch(_scale, dim=tuple(self.z.shape), inputs=[self.w_y32, self.w_temp], outputs=[self.w_z],
                  stream=self.warp_stream(torch.cuda.current_stream()))  # on torch's current stream
        self.r.copy_(self.z.amax(dim=1))                  # torch op after the Warp kernel (allocates)

    def new_inputs(self, i: int) -> None:
        x = torch.randn(self.x.shape, generator=torch.Generator().manual_seed(100 + i)) * (i + 2)
        if self.x_host is not None:
            self.x_host.copy_(x)  # host write: the previous replay has finished reading it (synchronized)
            self.x.zero_()        # so that only the graph's own copy can bring the values in
        else:
            self.x.copy_(x)
        self.temp.fill_(0.75 + 0.25 * i)

    def check(self, what: str) -> None:
        if self.x_host is not None:
            assert torch.equal(self.x.cpu(), self.x_host), f"{what}: the staged input did not reach the device"
        q, s = torch.ops.cutlass_w8a8.quantize_per_token(self.x.to(torch.bfloat16), self.layer.quant_dtype)
        ref = reference(q, self.layer.weight.t(), s, self.layer.weight_scale, self.layer.bias)
        assert_close_to_reference(self.y, ref, torch.bfloat16, what=f"{what}: W8A8Linear")
        assert torch.equal(self.y32, self.y.float()), f"{what}: float32 copy"
        assert torch.equal(self.z, self.y.float() * self.temp), f"{what}: Warp kernel"
        assert torch.equal(self.r, self.z.amax(dim=1)), f"{what}: row max after the Warp kernel"


def warm_up(p: Pipeline, stream: torch.cuda.Stream) -> None:
    """One eager step on ``stream``: loads the Warp module and makes the Warp stream, outside any capture."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        p.step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def capture(p: Pipeline, owner: str, stream: torch.cuda.Stream):
    """Capture ``p.step()`` on ``stream`` into a graph owned by ``owner``; returns ``replay()``, which runs it
    ordered after the current stream's work (and the current stream after it)."""
    torch.cuda.set_sync_debug_mode("error")  # no op of the step may sync the host
    try:
        if owner == "torch":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                assert torch.cuda.current_stream() == stream
                p.step()
            return g.replay
        ws = p.warp_stream(stream)
        pool = torch.cuda.MemPool()
        with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool), wp.ScopedCapture(stream=ws) as cap:
            p.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = cap.graph

    def replay():
        stream.wait_stream(torch.cuda.current_stream())
        wp.capture_launch(graph, stream=ws)
        torch.cuda.current_stream().wait_stream(stream)

    replay.keep_alive = (pool, graph)  # the pool's blocks are the graph's memory
    return replay


def run_and_check(owner: str, m: int = 8, staged: bool = False, replays: int = 4, seed: int = 0) -> None:
    """Build, warm up, capture and replay a pipeline, new inputs before every replay, each one checked."""
    p = Pipeline(make_layer(seed), m, staged)
    stream = torch.cuda.Stream()
    p.new_inputs(-1)
    warm_up(p, stream)
    p.check(f"{owner} eager warm-up")
    replay = capture(p, owner, stream)
    for i in range(replays):
        p.new_inputs(i)
        replay()
        torch.cuda.synchronize()
        p.check(f"{owner}-owned replay {i} (m={m}{', staged' if staged else ''})")


@pytest.mark.parametrize("m", [8, 100])
@torch.no_grad()
def test_warp_owned_capture_with_w8a8_linear(warp_device, m):
    """wp.ScopedCapture on a Warp stream made from a torch stream; torch ops, W8A8Linear and the Warp kernel
    in one graph, replayed by wp.capture_launch."""
    run_and_check("warp", m=m)


@torch.no_grad()
def test_torch_capture_with_warp_kernel_on_torch_stream(warp_device):
    """torch.cuda.graph; the Warp kernel launched on torch's current (capturing) stream."""
    run_and_check("torch", m=8, seed=1)


@pytest.mark.parametrize("owner", OWNERS)
@torch.no_grad()
def test_pinned_host_staging_inside_capture(warp_device, owner):
    """A pinned host buffer copied in with non_blocking=True inside the graph: rewriting it on the host
    between replays changes what each replay computes."""
    run_and_check(owner, m=16, staged=True, seed=2)


# ----------------------------------------------------------------------------------------------------
# what breaks a capture, and that the process goes on


def _legacy_stream_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    with torch.cuda.stream(torch.cuda.default_stream()):  # torch's default stream: the legacy stream (handle 0)
        dst.copy_(src)


# name -> (the offending operation, a phrase the errors must hold besides "captur")
OFFENDERS = {
    "legacy-stream copy": (_legacy_stream_copy, "legacy stream"),
    "synchronous device-to-host copy": (lambda src, dst: src.cpu(), ""),
    "pageable host-to-device copy": (lambda src, dst: dst.copy_(torch.ones(src.shape)), ""),
}


@functools.lru_cache(maxsize=None)
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _stream_flags(handle: int):
    """``cuStreamGetFlags`` of a CUDA stream (1: non-blocking), or None where libcuda cannot be asked."""
    lib = _libcuda()
    if lib is None:
        return None
    flags = ctypes.c_uint(0)
    if lib.cuStreamGetFlags(ctypes.c_void_p(handle), ctypes.byref(flags)) != 0:
        return None
    return flags.value


def _messages(exc: BaseException) -> str:
    """The messages of ``exc`` and of the exceptions it was raised from or while handling."""
    seen, out = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


# Set in the child process of test_unsafe_operation_fails_capture_and_process_recovers to the offender's name.
_CHILD_ENV = "CUTLASS_W8A8_WARP_UNSAFE_CHILD"


@pytest.mark.parametrize("offender", list(OFFENDERS))
def test_unsafe_operation_fails_capture_and_process_recovers(offender):
    """An operation that a capture cannot hold, inside a Warp-owned capture on a (blocking) Warp stream, fails
    the capture with a CUDA error that says so; afterwards the same stream captures and replays correctly, and
    so do both kinds of full pipeline capture (`_unsafe_capture_case`).

    Each case runs in a fresh process (``python -m pytest`` on this file, selecting
    ``test_unsafe_capture_in_this_process``, which exists only there): a failed capture is process state, and
    in one process the cases depended on what ran before them (on an H200, the synchronous device-to-host case
    failed after the decoder's Warp test, ``pytest tests/graphs/test_warp_cuda.py tests/models/test_decoder_cuda.py -k
    warp``, and passed with this file alone). A skip in the child (no blocking stream, per-thread default
    streams) is a skip here.
    """
    env = dict(os.environ, **{_CHILD_ENV: offender})
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           f"{os.path.abspath(__file__)}::test_unsafe_capture_in_this_process"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = f"{res.stdout[-6000:]}\n{res.stderr[-4000:]}"
    if res.returncode == 0 and " skipped" in res.stdout and " passed" not in res.stdout:
        reasons = [line for line in res.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(f"in the child process: {reasons[0] if reasons else out}")
    assert res.returncode == 0 and "1 passed" in res.stdout, f"child process failed:\n{out}"


if os.environ.get(_CHILD_ENV):
    @torch.no_grad()
    def test_unsafe_capture_in_this_process(warp_device):
        """The case named by the environment variable, in the child process (see the test above)."""
        _unsafe_capture_case(warp_device, os.environ[_CHILD_ENV])


def _unsafe_capture_case(warp_device, offender: str) -> None:
    """The body of test_unsafe_operation_fails_capture_and_process_recovers, run in its child process.

    - legacy-stream copy: a device copy on torch's default stream, the legacy stream, which synchronizes
      with every blocking stream, so with the capturing one ("would make the legacy stream depend on a
      capturing blocking stream", cudaErrorStreamCaptureImplicit);
    - synchronous device-to-host copy (``tensor.cpu()``) and pageable host-to-device copy: host-synchronous
      copies ("operation not permitted when stream is capturing").
    The capture is Warp's so that torch's caching allocator is not part of it: a failed ``torch.cuda.graph``
    capture leaves its pool registered as capturing in the allocator (``capture_end`` raises before
    ``endAllocateToPool``), after which ``torch.cuda.empty_cache()`` trips an internal assert.
    """
    op, phrase = OFFENDERS[offender]
    ws = wp.Stream(warp_device)  # Warp makes blocking streams (cuStreamCreate flags 0)
    if offender == "legacy-stream copy":
        if torch.cuda.default_stream().cuda_stream != 0:
            pytest.skip("torch's default stream is not the legacy stream here (per-thread default streams)")
        flags = _stream_flags(ws.cuda_stream)
        if flags is None or flags & 1:
            pytest.skip(f"needs a blocking capture stream; cuStreamGetFlags of Warp's stream gave {flags}")
    ts = wp.stream_to_torch(ws)
    src = torch.randn(64, 64, device="cuda")
    dst = torch.zeros_like(src)
    out = torch.zeros_like(src)
    temp = torch.full((1,), 2.0, device="cuda")
    w_dst, w_temp, w_out = wp.from_torch(dst), wp.from_torch(temp), wp.from_torch(out)
    wp.launch(_scale, dim=(64, 64), inputs=[w_dst, w_temp], outputs=[w_out], stream=ws)  # load the module
    torch.cuda.synchronize()

    with pytest.raises(RuntimeError) as info:
        with torch.cuda.stream(ts), wp.ScopedCapture(stream=ws):
            dst.copy_(src)  # captured
            op(src, dst)
    text = _messages(info.value)
    assert "captur" in text.lower() and phrase in text, text
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert not torch.cuda.is_current_stream_capturing()

    # The process goes on: eager work, a fresh capture on the same Warp stream, full pipeline captures.
    torch.cuda.synchronize()
    with torch.cuda.stream(ts), wp.ScopedCapture(stream=ws) as cap:
        dst.copy_(src)
        wp.launch(_scale, dim=(64, 64), inputs=[w_dst, w_temp], outputs=[w_out], stream=ws)
    for i in range(2):
        src.copy_(torch.randn(64, 64, device="cuda"))
        temp.fill_(1.5 + i)
        torch.cuda.synchronize()
        wp.capture_launch(cap.graph, stream=ws)
        torch.cuda.synchronize()
        assert torch.equal(out, src * temp), f"fresh capture after the failure, replay {i}"
    for owner in OWNERS:
        run_and_check(owner, m=8, replays=2, seed=3)
