"""A ring all-reduce (SUM) built from torch.distributed point-to-point sends and receives.

It exists to show, with counted bytes, why a ring all-reduce is bandwidth-optimal; training
uses the backend's own `dist.all_reduce` (through DDP). See docs/allreduce.md.

The algorithm, for N ranks in a ring (rank r sends to r+1 and receives from r-1, mod N):

1. Split the flat buffer into N chunks c_0..c_{N-1} (sizes differ by at most one element when
   N does not divide the length: the first `numel % N` chunks get the extra one, as in
   `torch.tensor_split`).
2. Reduce-scatter, N-1 steps: at step s rank r sends chunk (r - s) mod N to r+1 and adds the
   chunk (r - s - 1) mod N it receives from r-1 into its own copy. Each chunk travels the ring
   once, collecting one rank's contribution per hop, so after N-1 hops rank r holds the full sum
   of chunk (r + 1) mod N.
3. All-gather, N-1 steps: at step s rank r sends chunk (r + 1 - s) mod N and overwrites chunk
   (r - s) mod N with what it receives, so each finished chunk travels N-1 hops to reach every
   other rank.

Why 2(N-1)/N: in each phase a rank sends N-1 of the N chunks, about (N-1)/N of the buffer, and
there are two phases, so each rank sends about 2(N-1)/N times the buffer, at most twice the
buffer whatever N is, and every link of the ring carries the same load at every step. No
all-reduce can do with less per rank (Patarasuk and Yuan, 2009): the (N-1)/N of the buffer that
other ranks finish reducing has to leave each rank once, and their results have to come back. With
uneven chunks rank r sends exactly 2*numel - size(c_{r+1}) - size(c_{r+2}) elements (indices mod N),
and all ranks together send exactly 2(N-1)*numel.

The cost the ring pays for that is latency: 2(N-1) sequential steps, each waiting for the
slowest link, so for small buffers a tree or the backend's own algorithm wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RingStats:
    """What ring_all_reduce actually handed to the transport; accumulates over calls."""

    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0
    """Ring steps taken (2(N-1) per call with N > 1)."""
    messages_sent: int = 0
    """Non-empty sends (an empty chunk, possible when numel < N, is skipped on both ends)."""

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.steps = self.messages_sent = 0


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each of the world_size chunks of a flat buffer of numel elements."""
    base, extra = divmod(numel, world_size)
    bounds = []
    start = 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """Sum `tensor` across the ranks of `group` in place, over a ring; return it.

    Every rank of the group must call it with a tensor of the same shape and dtype, as with
    dist.all_reduce. Works for any dtype the backend can send and torch can add (not bool).
    `stats`, when given, accumulates the bytes this rank sent and received.
    """
    if tensor.dtype == torch.bool:
        # bool + bool is logical or in torch, not the SUM that dist.all_reduce would count.
        raise TypeError("ring_all_reduce sums; bool tensors have no sum of their own type")
    world_size = dist.get_world_size(group)
    if world_size == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    # P2POp takes global ranks even when a subgroup is given.
    ring = group if group is not None else dist.group.WORLD
    send_peer = dist.get_global_rank(ring, (rank + 1) % world_size)
    recv_peer = dist.get_global_rank(ring, (rank - 1) % world_size)

    # Chunks are slices of one flat contiguous view, so each send and receive is one
    # contiguous buffer and the receive of the all-gather can land in place.
    in_place = tensor.is_contiguous()
    flat = tensor.view(-1) if in_place else tensor.contiguous().view(-1)
    bounds = chunk_bounds(flat.numel(), world_size)
    largest = max(end - start for start, end in bounds)
    # One scratch buffer for the reduce-scatter receives: a partial sum from upstream has to
    # be added to this rank's own values, so it cannot land on top of them.
    scratch = torch.empty(largest, dtype=flat.dtype, device=flat.device)
    itemsize = flat.element_size()

    def chunk(i: int) -> torch.Tensor:
        start, end = bounds[i % world_size]
        return flat[start:end]

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        # Send and receive are posted together: with NCCL a lone blocking send to the next rank
        # would wait for its receive, which is itself waiting to send, all round the ring.
        # Empty chunks (numel < N) are skipped by sender and receiver alike, so a rank may sit
        # out a step; NCCL only needs every rank in the first batch of a lazily created
        # communicator, which init_process_group(device_id=...) creates eagerly instead.
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, send_peer, group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, recv_peer, group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if stats is not None:
            stats.steps += 1
            stats.bytes_sent += send.numel() * itemsize
            stats.bytes_received += recv.numel() * itemsize
            stats.messages_sent += 1 if send.numel() else 0

    for s in range(world_size - 1):
        incoming = chunk(rank - s - 1)
        landing = scratch[: incoming.numel()]
        exchange(chunk(rank - s), landing)
        incoming.add_(landing)

    for s in range(world_size - 1):
        exchange(chunk(rank + 1 - s), chunk(rank - s))

    if not in_place:
        tensor.copy_(flat.view(tensor.shape))
    return tensor
