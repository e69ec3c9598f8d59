//! # hvprof sample-log wire format
//!
//! One definition of the format, used by both sides: the hypervisor encodes (this crate without
//! features: `no_std`, no allocation, into caller-provided buffers) and `hvprof-analyze` decodes
//! (feature `std`: `decode`, `StreamDecoder`, and the `synth` trace generator).
//!
//! This comment is the specification. All multi-byte integers are little-endian.
//!
//! ## Stream
//!
//! The captured byte stream is console text (UTF-8, never containing `0x00`) interleaved with
//! binary frames. A frame is
//!
//! ```text
//! 0x00  COBS(payload)  0x00
//! ```
//!
//! COBS (consistent overhead byte stuffing, Cheshire & Baker 1999) removes every `0x00` from the
//! payload: the payload followed by a conceptual `0x00` is cut after each `0x00` and after each run
//! of 254 non-zero bytes; each piece is sent as a code byte (its number of non-zero bytes + 1,
//! `0x01..=0xFF`) followed by those non-zero bytes; the final conceptual `0x00` is not sent. A
//! piece of code `0xFF` is not followed by a `0x00` (so a payload ending in a 254-byte run ends
//! with an empty piece, code `0x01`). Encoded length ≤ `len + 1 + len / 254`. Two consecutive
//! frames are separated by two `0x00` bytes, so losing one delimiter never merges two frames.
//!
//! A reader splits the stream at every `0x00` and classifies each non-empty span:
//! - a **frame** if its bytes 1..4 are `"HVP"`, its byte 0 (the first COBS code) is ≥ 5 and its
//!   byte 4 (the frame type) is in `1..=15` — these bytes are the payload's first group, which COBS
//!   copies verbatim — and it decodes: CRC and structure correct;
//! - a **damaged frame** if it looks like one (the three conditions above) but does not decode,
//!   unless the rest of the span is valid UTF-8 (console text that happens to contain the
//!   pattern stays text; a damaged binary frame practically never is valid UTF-8);
//! - **console text** otherwise; spans that are not valid UTF-8 (for example the tail of a frame
//!   cut in two by a corrupted byte) are reported as unrecognised damage instead.
//!
//! A reader also recovers a frame whose delimiter was lost: it looks for the frame pattern inside
//! a span (leading `0x00` lost: text + frame), and accepts a frame whose structure ends before the
//! span does (trailing `0x00` lost: frame + text) when the CRC at the structural end matches.
//!
//! ## Payload
//!
//! ```text
//! offset  size  field
//! 0       3     magic "HVP" (0x48 0x56 0x50)
//! 3       1     frame type: 1 header, 2 block, 3 end, 4 task, 5 VM end, 6 pCPU cost,
//!               7 mapping (8..=15 reserved: skipped, counted)
//! 4       n     body (per type, below)
//! 4+n     4     CRC-32C of bytes 0..4+n, little-endian
//! ```
//!
//! CRC-32C is CRC-32/ISCSI (Castagnoli): reflected polynomial `0x82F63B78`, initial value and
//! final XOR `0xFFFFFFFF`; `crc32c(b"123456789") == 0xE3069283`. Every body is self-delimiting, so a
//! reader knows where the CRC must be even when trailing bytes follow.
//!
//! `varint` below is unsigned LEB128 (7 bits per byte, least significant group first, bit 7 set
//! on all but the last byte; at most 10 bytes; values wider than the field are malformed).
//! `bytes8` is a `u8` length followed by that many bytes.
//!
//! ### Header body (type 1)
//!
//! ```text
//! varint  version          (2; version 1 had no VM end and pCPU cost frames)
//! bytes8  build_id         hypervisor GNU build id, 0..=20 bytes (0 = none)
//! varint  tsc_hz
//! varint  pcpus            (u16)
//! varint  tsc_skew         max TSC skew across pCPUs, ticks (0 = unknown)
//! varint  period_ticks     nominal sampling period
//! u8      source           0 deadline clock, 1 PMU
//! u8      vm_count         0..=64, then per VM:
//!   varint  id             (u16)
//!   bytes8  name           UTF-8, 0..=32 bytes
//!   varint  vcpus          (u16)
//!   bytes8  image          UTF-8 file name, 0..=64 bytes
//!   bytes8  image_build_id 0..=20 bytes (0 = none)
//! ```
//! Sent first; may be sent again (e.g. at the end). Readers keep the first and count copies that
//! differ from it.
//!
//! ### Block body (type 2)
//!
//! One pCPU's consecutive records; it decodes on its own.
//!
//! ```text
//! varint  pcpu             (u16)
//! varint  seq              block number on this pCPU: 0, 1, 2, …
//! varint  first_sample     samples this pCPU sent in earlier blocks
//! varint  first_event      events this pCPU sent in earlier blocks
//! varint  ring_drops       the pCPU's cumulative ring-full drop counter
//! varint  period           the nominal period sample TSCs are coded against
//! varint  count            records in the block, 0..=1024
//! u32     params           code parameters (below), little-endian
//! …       bitstream        `count` records, zero-padded to a whole byte
//! ```
//!
//! Lost blocks are gaps in `seq`; the samples (events) they held are the gap in `first_sample`
//! (`first_event`) between the blocks around them, so loss is counted exactly.
//!
//! `params`: bits 0..6 `k_tsc`, 6..12 `k_rip`, 12..18 `k_cost`, 18..24 `k_evt` (each 0..=63),
//! 24..26 `k_slot` (0..=3), bit 26 `chains` (the samples carry call chains, below; version 3),
//! 27..32 zero. The encoder picks each as the value giving the block the
//! fewest bits (the smallest on ties), so its output is deterministic.
//!
//! **Bitstream.** Bits are packed LSB-first: stream bit `i` is bit `i % 8` of byte `i / 8`, and an
//! `n`-bit field `uN` is written least significant bit first. Codes:
//! - `bit`: one bit (1 = true).
//! - `lp5(v)`: the bit length `L` of `v` (0 for 0) as u5 (≤ 16), then the `L` low bits of `v`.
//!   `lp7(v)`: the same with a u7 length (≤ 64).
//! - `rice_k(v)`: `q = v >> k`; if `q < 3`: `q` one bits, a zero bit, then the `k` low bits of
//!   `v`; else (escape): three one bits, then `n - k - 2` as u6 where `n` is the bit length of `v`
//!   (`n ≥ k + 2` here), then the `n - 1` low bits of `v` (its top bit is implied). Readers reject
//!   `n > 64`.
//! - `srice_k(v)`: `v >> k` one bits, a zero bit, the `k` low bits of `v` (no escape; used for
//!   values ≤ 15, readers reject quotients above `15 >> k`).
//! - `zz(x)`: zigzag of a two's-complement 64-bit difference, `(x << 1) ^ (x >> 63)`. Differences
//!   of 64-bit fields wrap modulo 2^64, so every value round-trips (TSCs going backwards,
//!   `u64::MAX` RIPs); the `cost` difference is exact (`i64`).
//!
//! **Delta state**, reset to zero at every block start:
//! - `last_tsc` (previous record), `last_sample_tsc` (previous sample), `kind` (of the previous
//!   sample, initially Guest);
//! - two contexts `ctx[0]` (used by Guest and Hypervisor samples) and `ctx[1]` (Idle samples),
//!   each with `vm`, `vcpu`, `vpid`, `cr3[5]` and `exit[5]` (current value first, then earlier
//!   distinct values, most recent first), `mode[2]` (current, previous) and `rips[16]` (recent
//!   guest RIPs, most recently used first);
//! - per sample kind: `host_rip[kind]`, `cost[kind]`; and `host_ref`, the last non-zero host RIP.
//!
//! Each record starts with a prefix:
//!
//! ```text
//! 0           sample, no field changed
//! 1 0 u3 f    sample, only field f changed
//! 1 1 0 u8 m  sample, the fields whose bits are set in m changed
//! 1 1 1       event
//! ```
//!
//! **Sample.** Fields: 0 kind, 1 vm, 2 vcpu, 3 vpid, 4 guest_cr3, 5 guest_mode, 6 exit_reason,
//! 7 host_rip. "Changed" compares `kind` with `state.kind`, fields 1..=6 with `C = ctx[kind ==
//! Idle]` (using the sample's own kind), `host_rip` with `host_rip[kind]`; an unchanged field takes
//! that value. Changed fields follow in field order:
//!
//! ```text
//! kind         u2 (0 Guest, 1 Hypervisor, 2 Idle)
//! vm, vcpu,    lp5 each
//! vpid
//! guest_cr3    bit h; h = 1: u2 j, cr3 = C.cr3[1 + j]; h = 0: lp7(zz(cr3 - C.cr3[0]))
//! guest_mode   bit h; h = 1: mode = C.mode[1]; h = 0: u4 low, bit b, (if b: u4 high),
//!              mode = low | high << 4
//! exit_reason  bit h; h = 1: u2 j, exit = C.exit[1 + j]; h = 0: lp5(exit)
//! host_rip     lp7(zz(host_rip - host_ref))
//! ```
//!
//! then always
//!
//! ```text
//! rice_k_tsc(zz(tsc - last_sample_tsc - period))
//! srice_k_slot(slot)   0..=15
//! bit exact            guest_rip = C.rips[slot] if exact, else
//! rice_k_rip(zz(guest_rip - C.rips[slot]) - 1)
//! rice_k_cost(zz(cost - cost[kind]))
//! ```
//!
//! then, in a block whose `chains` bit is set, the sample's two call chains (below),
//! and updates the state: `last_tsc = last_sample_tsc = tsc`, `state.kind = kind`,
//! `host_rip[kind] = host_rip`, `host_ref = host_rip` if it is non-zero, `cost[kind] = cost`,
//! `C.vm/vcpu/vpid` take the sample's; a new `cr3` (or `exit`) moves to the front of its list (if
//! found at index `i ≥ 1` the entries `0..=i` rotate right by one, else all entries shift right
//! by one, the last falls off, and it goes to index 0); a new `mode` makes `C.mode = [mode,
//! C.mode[0]]`; the RIP goes to the front of `C.rips` (exact: entries `0..=slot` rotate right by
//! one; else all shift right by one, the last falls off, `C.rips[0] = guest_rip`). The encoder
//! codes a RIP against the slot with the smallest `zz` difference (the lowest slot on ties) and a
//! history value by its first index.
//!
//! **Call chains** (version 3). A chain is a list of up to 32 return addresses, innermost first,
//! with a depth and an end (`Chain`: 0 complete, 1 cut at the depth limit, 2 a bad frame, 3 not
//! walked). A sample carries its host chain (the hypervisor's callers of `host_rip`) then its
//! guest chain (a guest sample: the callers of `guest_rip`; a hypervisor sample during a vCPU's
//! exit: the guest RIP at the exit, then its callers). Each is coded against a reference chain:
//! the host chain against the previous host chain of the same sample kind, the guest chain
//! against the previous guest chain of the same (kind, vm, vcpu), found in a list of the four
//! most recently used such keys (a key not in the list has the empty, not-walked reference and
//! replaces the least recently used entry). All references are reset at the block start.
//!
//! ```text
//! bit same        1: the chain equals its reference (end, depth and frames)
//! (same = 0:)
//! u2 end
//! lp3(depth)      0..=32
//! lp3(shared)     outermost frames equal to the reference's outermost, ≤ depth
//! per new frame i in 0..depth-shared (innermost first):
//!   lp7(zz(frame - ref_i))
//! ```
//!
//! `ref_i` is the reference's frame at the same distance from the outermost frame when it has
//! one, else the previous new frame, else (for `i = 0`) the sample's leaf: `host_rip` for the
//! host chain, `guest_rip` for the guest chain. The encoder takes the longest shared suffix.
//! Then the chain becomes the reference of its key. The block's frame list (what a decoder
//! returns beside the records) holds every sample's host then guest frames, in record order.
//!
//! **Event.**
//!
//! ```text
//! u1 kind      0 VcpuIn, 1 VcpuOut
//! bit d        d = 1: vm lp5, vcpu lp5; d = 0: vm, vcpu = ctx[0].vm, ctx[0].vcpu
//! u2 reason    0 Preempted, 1 Halted, 2 Stopped, 3 Yielded
//! rice_k_evt(zz(tsc - last_tsc))
//! ```
//!
//! then `last_tsc = tsc`, `ctx[0].vm = vm`, `ctx[0].vcpu = vcpu`.
//!
//! Readers require the bitstream to end exactly where the CRC starts (`ceil(bits / 8)` bytes).
//!
//! ### Task body (type 4)
//!
//! Which guest task (Linux: a thread) a vCPU runs from a sample on. The hypervisor reads it from
//! guest memory when it samples a guest and sends it when it differs from the vCPU's last one;
//! the vCPU's samples from `tsc` on belong to it until its next task frame.
//!
//! ```text
//! varint  pcpu             (u16)
//! varint  tsc              the sample's TSC
//! varint  vm, vcpu         (u16 each)
//! varint  cr3              guest CR3
//! varint  task             guest-virtual address of the task structure
//! varint  pid, tgid        (u32 each) thread and process ids
//! bytes8  comm             UTF-8, 0..=16 bytes
//! ```
//!
//! ### End body (type 3)
//!
//! ```text
//! varint  count            pCPU entries, then per pCPU:
//!   varint  pcpu           (u16)
//!   varint  samples        samples sent in blocks (= next first_sample)
//!   varint  events         events sent in blocks
//!   varint  ring_drops     final ring-drop counter
//!   varint  blocks         blocks sent (= next seq)
//! ```
//! Without an end frame a reader cannot tell how many blocks were lost after the last one it
//! received: it reports the capture as truncated.
//!
//! ### VM end body (type 5)
//!
//! What the hypervisor knows exactly about a VM when it stops ([`VmEnd`]): its exit statistics
//! (every exit of every vCPU, the handler cost from VM exit to the next VM entry), its vCPU 0's
//! IA32_LSTAR (a Linux guest's KASLR slide) and the task offsets it was profiled with. Sent once
//! per VM; a reader keeps the last one per VM. Console text says the same for people; readers
//! take it from here only.
//!
//! ```text
//! varint  vm               (u16)
//! varint  lstar            0 = never written
//! u8      offsets          0 none, 1: varint current_task, pid, tgid, comm (the last three u32)
//! varint  other            exits whose basic reason is ≥ 80
//! u8      rows             0..=80, then per row, in strictly ascending reason order:
//!   u8      reason         basic exit reason, < 80
//!   varint  count          ≥ 1
//!   varint  total, min, max  handler cost, TSC ticks (min ≤ max)
//!   u16     buckets        bit b set: histogram bucket b is non-zero
//!   varint  per set bit, ascending: that bucket's count (u32, ≥ 1)
//! u8      ports            0..=16, then per port (distinct): varint port (u16), varint count ≥ 1
//! varint  ports_other      I/O exits on ports beyond the first 16
//! u8      ple              0 no pause-loop exiting, 1 on, 2 directed (a frame that ends before
//!                          this byte: 0); then, for 1 and 2:
//!   varint  gap, window    PLE_Gap and PLE_Window, TSC ticks (u32 each)
//!   u8      sites          0..=64, then per site: varint vcpu (u16), rip, exits (≥ 1)
//!   varint  others         exits at guest RIPs beyond the sites
//! u8      vpmu             0 no virtual PMU, 1 `vpmu=cpu`, 2 `vpmu=domain` (a frame that ends
//!                          before this byte: 0); then, for 1 and 2:
//!   u8      vcpus          1..=8, then per vCPU: varint vcpu (u16), guest_ticks, emulated,
//!                          hypervisor_ticks, pmis, held, undelivered, exits, exit_ticks
//!                          ([`VpmuCounts`])
//! u8      isolation        the Linux guest's page-table isolation (KPTI): 0 not found out,
//!                          1 off, 2 on (a frame that ends before this byte: 0)
//! ```
//!
//! Histogram bucket 0 counts costs below 64 ticks, bucket `b` in `1..=14` costs in
//! `[2^(5+b), 2^(6+b))`, bucket 15 costs from 2^20 on ([`histogram_bucket`]); counts saturate at
//! `u32::MAX`.
//!
//! ### pCPU cost body (type 6)
//!
//! The profiler's whole cost on one pCPU ([`PcpuCost`]), sent at the end of the run, one frame
//! per pCPU: ten varints after the pCPU number.
//!
//! ```text
//! varint  pcpu                 (u16)
//! varint  span_ticks           start of sampling on this pCPU to its end
//! varint  samples
//! varint  sampling_exits, sampling_exit_ticks   exits that exist only to take a sample
//! varint  timer_interrupts, timer_ticks         LAPIC timer interrupts (hypervisor, idle)
//! varint  other_sample_ticks   the sample path of samples taken on other exits
//! varint  export_ticks         draining, encoding and sending the log during the run
//! varint  task_reads, task_read_ticks           (inside the parts above)
//! ```
//! The whole cost is `sampling_exit_ticks + timer_ticks + other_sample_ticks + export_ticks`.
//!
//! ### Mapping body (type 7)
//!
//! Executable code a guest maps ([`Mapping`]), read by the hypervisor from the guest's memory:
//! an executable file mapping of a process (when the process is first seen or has exec'd), or a
//! loaded kernel module.
//!
//! ```text
//! varint  pcpu, tsc, vm, vcpu
//! u8      kind             0 process mapping, 1 kernel module
//! varint  cr3, tgid        the process (0 for a module; tgid a u32)
//! varint  start, end       start < end
//! varint  pgoff            file offset of start, in 4 KiB pages (0 for a module)
//! bytes8  path             UTF-8, 0..=255 bytes: the file's path, or the module's name
//! bytes8  build_id         0..=20 bytes (0 = not read)
//! ```
//!
//! ## Size
//!
//! On the synthetic trace of `synth` (1 kHz samples with jitter, a few hot functions per
//! address space, rare CR3 changes, three VMs on four pCPUs, 64-record blocks) the stream takes
//! about 5.75–5.8 bytes per sample, framing, CRC, header and end frames included (about 5.05 with
//! 255-record blocks); the `size` test measures and prints it. A block costs about 29 bytes of
//! framing and header plus its first record coded against zeros.
//!
//! ## Limits
//!
//! At most 1024 records per block, 64 VMs per header, 4096 pCPU entries per end frame. Size
//! buffers with [`max_block_frame_len`], [`MAX_HEADER_FRAME_LEN`], [`max_end_frame_len`]: the
//! encoder COBS-encodes in place and needs slightly more room than the frame's final length.

#![cfg_attr(not(any(feature = "std", test)), no_std)]
#![forbid(unsafe_code)]
// Codecs truncate silently when a cast is wrong: every narrowing is `try_from` or a named,
// documented helper (`bits::low_u8`, `bits::low_u32`).
#![deny(clippy::cast_possible_truncation)]
#![warn(missing_docs)]

mod bits;
pub mod channel_test;
mod cobs;
mod codec;
mod encode;
mod stats;
mod types;

#[cfg(feature = "std")]
mod decode;
#[cfg(feature = "std")]
pub mod synth;

pub use cobs::max_encoded_len as cobs_max_encoded_len;
pub use encode::{
    BlockEncoder, EncodeError, FRAME_BLOCK, FRAME_END, FRAME_HEADER, FRAME_MAPPING, FRAME_OUTPUT,
    FRAME_PCPU_COST, FRAME_TASK, FRAME_VM_END, MAGIC, MAX_BLOCK_RECORDS, MAX_END_PCPUS,
    MAX_FRAME_TYPE, MAX_HEADER_FRAME_LEN, MAX_MAPPING_FRAME_LEN, MAX_OUTPUT_CHUNK,
    MAX_OUTPUT_FRAME_LEN, MAX_PCPU_COST_FRAME_LEN, MAX_TASK_FRAME_LEN, MAX_VM_END_FRAME_LEN,
    crc32c, encode_block, encode_end, encode_header, encode_mapping, encode_output,
    encode_pcpu_cost, encode_task, encode_vm_end, frame_buffer_len, max_block_frame_len,
    max_end_frame_len,
};
pub use stats::{
    EXIT_PORTS, EXIT_REASONS, ExitStats, HISTOGRAM_BUCKETS, MAX_SPIN_SITES, MAX_VPMU_VCPUS,
    PauseLoop, PcpuCost, ReasonStats, SpinSite, Table, TaskOffsets, VmEnd, VpmuCounts, VpmuEnd,
    histogram_bucket, histogram_bucket_start,
};
pub use types::{
    BUILD_ID_LEN, BlockHeader, BuildId, COMM_LEN, CapacityError, Event, EventKind, FORMAT_VERSION,
    FixedStr, Header, IMAGE_NAME_LEN, MAX_VMS, MODE_LONG, MODE_PROTECTED, MODE_REAL, Mapping,
    MappingKind, NO_EXIT, NO_VCPU, NO_VM, OutReason, Output, OutputStream, PATH_LEN, PcpuTotals,
    Record, SOURCE_DEADLINE, SOURCE_PMU, Sample, SampleKind, Task, VM_NAME_LEN, VmInfo, VmList,
    guest_mode,
};
pub use types::{Chain, ChainEnd, Chains, MAX_CHAIN_DEPTH, chain_frames, with_chains};

#[cfg(feature = "std")]
pub use decode::{
    BlockAt, BlockReader, Collector, Damage, DamageKind, Decoded, Gap, Item, PcpuLog,
    StreamDecoder, TextSpan, decode, decode_metadata_parallel, decode_parallel,
};
