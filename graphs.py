"""
Host time: CUDA graphs and the gradient average over processes. routing_kernel.py makes the GPU's work small; this
file keeps the host from being the bottleneck once it is. A reader of the method never needs to open it.

A small model's step is hundreds of kernels launched from Python, and at the paper's microbatches the launches, not
the kernels, can set the pace (BENCHMARKS.md). A CUDA graph records a step's kernels once and replays them with one
launch. Three steps are graphed here, all through capture(): a training microbatch (GraphedMicrostep), a decode step
of generation (DecodeGraph) and bench.py's routing chain. Graphs replay fixed shapes and addresses, so DDP's gradient
hooks cannot run inside them: the average over processes is one all-reduce after the graphs (sync_grads), or
bucketed all-reduces captured under the backward (OverlappedGradSync).

Imports torch and torch.distributed, never model.py.
"""
import functools

import torch
import torch.distributed as dist


class GraphCaptureError(RuntimeError):
    """A step could not be captured as a CUDA graph (its warm-up ran; the error is the cause)."""


def capture(fn, warmup=2, pool=None, before_capture=None):
    """(graph, fn's output at capture): fn() run `warmup` times on a side stream (compilation, autotuning and the
    allocator settle outside the graph), then before_capture(), then fn() recorded as a CUDA graph in `pool`. An error
    while recording raises GraphCaptureError; one in the warm-up propagates as it is (the eager step fails too)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    except Exception as e:   # e.g. an op that syncs with the host
        raise GraphCaptureError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return graph, out


# ---- training: one microbatch's forward and backward ----------------------------------------------------------------

class GraphedMicrostep:
    """One microbatch's forward and backward captured as CUDA graphs and replayed: the host launches one graph
    instead of hundreds of kernels (compiled sublayers, ~3 Triton launches per routing site), so small
    microbatches stop being bound by Python and launch overhead. Two graphs share one memory pool: the first
    microbatch of a step writes the gradients (captured with every .grad unset, so backward stores into them as
    eager autograd does after zero_grad(set_to_none=True)); later microbatches add into them. The graphs fix the
    batch shape, their input buffers and the .grad tensors: never set .grad to None afterwards (no zero_grad
    needed, the first microbatch overwrites). The model is not wrapped in DDP or FSDP (their gradient hooks are
    not captured here): under torchrun, train.py averages the gradients after the graphs (sync_grads), or, given
    grad_sync (an OverlappedGradSync), a third graph for the step's last microbatch holds the average, started
    under its backward: then the .grad tensors are views into grad_sync's buffer, which the first microbatch's graph
    zeroes. The model must run without host syncs (every mode does).

        micro = GraphedMicrostep(model, autocast, loss_scale=1 / accum)
        loss = micro(x, y, first=k == 0, last=k == accum - 1)   # each kind's first call warms up and captures
    """

    def __init__(self, model, autocast, loss_scale=1.0, warmup=3, grad_sync=None):
        self.model, self.autocast, self.loss_scale, self.warmup = model, autocast, loss_scale, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_sync = grad_sync
        self.graphs, self.losses = {}, {}   # (first, last) -> CUDAGraph, its loss output (last: with grad_sync only)
        self.x = self.y = None

    def _forward_backward(self, first, last):
        if self.grad_sync is not None:
            if first:
                self.grad_sync.zero_grad()
            self.grad_sync.begin(last)
        with self.autocast:
            _, loss = self.model(self.x, self.y)
        (loss * self.loss_scale).backward()
        if self.grad_sync is not None:
            self.grad_sync.finish()
        return loss.detach()

    def _unset_grads(self):   # the captured backward allocates .grad in the graph's pool and writes it
        for p in self.params:
            p.grad = None

    def _capture(self, kind):
        first, last = kind
        if not first and not any(f for f, _ in self.graphs):
            raise RuntimeError("GraphedMicrostep: the first microbatch of a step (first=True) must come first")
        saved = None if first else [p.grad.clone() for p in self.params]   # this step's gradients so far
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        try:
            graph, self.losses[kind] = capture(functools.partial(self._forward_backward, first, last), self.warmup,
                                               pool, self._unset_grads if first and self.grad_sync is None else None)
        except GraphCaptureError as e:   # undo this microbatch, say what failed
            for p, g in zip(self.params, saved or [None] * len(self.params)):
                p.grad = g
            if self.grad_sync is not None:   # the eager steps that follow average after the backward (sync_grads)
                self.grad_sync.close()
            self.graphs.clear()
            self.losses.clear()
            raise GraphCaptureError(f"capturing the graph of the {'first microbatch' if first else 'later microbatches'} "
                                    f"failed ({e})") from e.__cause__
        if saved is not None:
            with torch.no_grad():   # the warm-up added extra gradients: restore this step's
                torch._foreach_copy_([p.grad for p in self.params], saved)
        self.graphs[kind] = graph

    def __call__(self, x, y, first=True, last=True):
        if self.x is None:
            self.x, self.y = x.clone(), y.clone()   # the graphs' input buffers
        else:
            self.x.copy_(x, non_blocking=True)
            self.y.copy_(y, non_blocking=True)
        kind = (first, last and self.grad_sync is not None)   # without grad_sync the last microbatch is like the others
        if kind not in self.graphs:
            self._capture(kind)
        self.graphs[kind].replay()
        return self.losses[kind]


# ---- several processes: the gradient average ---------------------------------------------------------------------

def sync_grads(params, world):
    """Average the gradients over the processes in one all-reduce (DDP without its hooks: graphed steps)."""
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world)
    torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))


class OverlappedGradSync:
    """The gradient average of graphed steps, started during the backward instead of after it: DDP's bucketed
    reducer in a form a CUDA graph can capture. Every .grad is a view into one flat buffer, laid out in the order the
    backward finishes the gradients and cut into buckets of ~bucket_mb; a hook on each parameter launches its bucket's
    all-reduce (async, on the process group's stream) once the bucket's last gradient is written, so the transfer runs
    under the rest of the backward. Buckets launch in index order on every process, as collectives must; finish()
    joins them. Inside a captured microbatch the hooks run once, at capture, and each replay repeats their all-reduces.

        sync = OverlappedGradSync(params)
        sync.zero_grad(); sync.begin(last=True); loss.backward(); sync.finish()   # .grad: the mean over processes

    The first backward only records the order (rank 0's is used everywhere), then builds the buffer and, on a last
    microbatch, averages it in one all-reduce. A parameter that got no gradient stays out (its .grad stays None)."""

    def __init__(self, params, bucket_mb=25.0):
        self.params, self.bucket_bytes = list(params), bucket_mb * 2**20
        self.flat = None     # the gradients, one buffer; None until the first backward has shown their order
        self.buckets = []    # (start, end, number of parameters) in flat, in launch order
        self.bucket_of = {}  # parameter index -> its bucket
        self.order, self.armed, self.works = [], False, []
        self.hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                      for i, p in enumerate(self.params)]

    def zero_grad(self):
        """Zero the buffer (the gradients stay its views); before it exists, unset every .grad."""
        if self.flat is not None:
            self.flat.zero_()
        else:
            for p in self.params:
                p.grad = None

    def begin(self, last):
        """Before a backward: on the step's last microbatch, average the gradients during it; else only accumulate."""
        self.armed, self.next, self.works = last, 0, []
        self.left = [n for _, _, n in self.buckets]   # gradients each bucket still waits for

    def _ready(self, i, p):   # p.grad is final for this backward
        if self.flat is None:
            if i not in self.bucket_of:   # the first backward: record the order
                self.bucket_of[i] = None
                self.order.append(i)
            return
        b = self.bucket_of.get(i)
        if self.armed and b is not None:
            self.left[b] -= 1
            while self.next < len(self.buckets) and self.left[self.next] == 0:
                self._launch()

    def _launch(self):
        self.works.append(dist.all_reduce(self.views[self.next], op=dist.ReduceOp.AVG, async_op=True))
        self.next += 1

    def finish(self):
        """After the backward: on the last microbatch, wait for every bucket's all-reduce (launching any left)."""
        if self.flat is None:
            self._build()
            if self.armed:
                dist.all_reduce(self.flat, op=dist.ReduceOp.AVG)
        elif self.armed:
            while self.next < len(self.buckets):
                self._launch()
            for work in self.works:
                work.wait()
        self.armed, self.works = False, []

    def _build(self):
        """The buffer from the recorded order (rank 0's), each gradient moved into its view."""
        shared = [self.order]
        dist.broadcast_object_list(shared, src=0)   # one layout on every process: the collectives must match
        order = shared[0]
        dtypes = sorted({str(self.params[i].dtype) for i in order})
        if len(dtypes) != 1:
            raise ValueError(f"grad_sync=overlap needs one gradient dtype, the parameters have {dtypes}: "
                             "use --grad_sync=after")
        first = self.params[order[0]]
        self.flat = torch.zeros(sum(self.params[i].numel() for i in order), dtype=first.dtype, device=first.device)
        self.bucket_of, start, end, count = {}, 0, 0, 0
        for i in order:
            p = self.params[i]
            if count and (end - start + p.numel()) * p.element_size() > self.bucket_bytes:
                self.buckets.append((start, end, count))
                start, count = end, 0
            view = self.flat[end:end + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self.bucket_of[i] = len(self.buckets)
            end, count = end + p.numel(), count + 1
        self.buckets.append((start, end, count))
        # each bucket's view, made once and held here: a view made per launch is dropped by Python while the backend's
        # worker thread may still hold it; that thread then frees the view's Python object, taking the GIL, which at
        # interpreter exit can abort the process (gloo: "terminate called without an active exception", twice in the
        # 2-process CPU test of this class under load)
        self.views = [self.flat[s:e] for s, e, _ in self.buckets]

    def close(self):
        """Remove the hooks: the gradients are averaged some other way from now on."""
        for hook in self.hooks:
            hook.remove()
        self.armed, self.works = False, []


# ---- generation: one decode step ------------------------------------------------------------------------------------
# A one-token forward is a few hundred small kernels launched from Python; on a GPU the host's launch time, not the
# kernels, sets the pace of eager decoding. The step below has fixed shapes and addresses (the position lives on the
# device, attention reads the whole cache under a mask), so it is recorded once per generate call and replayed for
# every new token.

class DecodeGraph:
    """One-token steps over a generation.KVCache: step(token (B, 1)) -> logits (B, 1, vocab), cache.pos advanced.
    capture() records the step as a CUDA graph; built directly (graph None) it runs the same step eagerly (tests)."""
    MIN_TOKENS = 16   # generate graphs only this many new tokens or more: the capture costs a few eager steps

    def __init__(self, model, cache, token):
        self.model, self.cache, self.graph, self.logits = model, cache, None, None
        self.token = token.clone()                                   # the step's input, (B, 1)
        self.pos = torch.zeros(1, dtype=torch.long, device=token.device)   # its position, on the device

    def _forward(self):
        self.cache.step_pos = self.pos
        try:
            return self.model(self.token, cache=self.cache)[0]
        finally:
            self.cache.step_pos = None

    def __call__(self, token):
        self.token.copy_(token)
        self.pos.fill_(self.cache.pos)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        self.cache.pos += 1
        return self.logits

    @classmethod
    def capture(cls, model, cache, token, say=print):
        """The graphed step at cache.pos, or False where capture fails (say() gets one line why; generate then steps
        eagerly). The warm-up steps write token's keys and values at cache.pos, as the first replay will again."""
        step, pos = cls(model, cache, token), cache.pos

        def forward_at_pos():
            cache.pos = pos
            return step._forward()
        try:
            step.pos.fill_(pos)
            step.graph, step.logits = capture(forward_at_pos)
        except Exception as e:   # an op that cannot be captured: eager decoding still works
            e = e.__cause__ if isinstance(e, GraphCaptureError) and e.__cause__ is not None else e
            say(f"*** generate: the decode step could not be captured as a CUDA graph ({type(e).__name__}: "
                f"{e}); decoding eagerly (pass cuda_graph=False to silence this) ***")
            step = False
        cache.pos = pos
        return step
