//! Export of the sample log, outside the sample path: the rings are drained into framed,
//! checksummed, delta-encoded blocks (`hvprof-samplelog`, the one definition of the wire format)
//! on the chosen channel (`channel=`: the console UART, interleaved with its text, or the
//! parallel port).
//!
//! Two modes (`export=` boot option):
//! - `stream`: a block is encoded and sent whenever a ring holds one, during the run. The cost of
//!   encoding and sending shows in the profile as hypervisor time, as it should. The export never
//!   takes more than about half of a pCPU's time (`over_export_share`): beyond, the ring fills
//!   and counts its drops, and the guests still run.
//! - `end`: records are moved from the ring into a large in-memory buffer during the run (a copy,
//!   no encoding) and sent when the VMs have stopped. When the buffer fills, the older half is
//!   encoded and sent at once (a synchronous flush: the run waits, the time is counted and
//!   reported as the profiler's), so nothing is lost however long the run.
//!
//! Each pCPU's log is its own (its lock is taken only by that pCPU, and by the boot CPU at the
//! end), so no pCPU waits for another's export; the channel serialises whole frames.
//!
//! Losses are exact and placed: a record carries the ring's drop count when it was pushed, and a
//! block never spans a change of that count, so a block's `ring_drops` counts the records lost
//! before its first record (the decoder places each loss between two blocks).

use super::sampler::{self, CpuProfiler, Slot};
use crate::percpu::MAX_CPUS;
use crate::tsc::rdtsc;
use crate::{console, memory, parallel, println, virtio_console};
use alloc::vec::Vec;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicU64, Ordering};
use hvprof_boot::cmdline::{Channel, Export};
use hvprof_hypervisor::profiler::slots::{Block, fill_block, frame_slots};
use hvprof_samplelog::{
    BlockEncoder, BuildId, FixedStr, Header, MAX_BLOCK_RECORDS, MAX_CHAIN_DEPTH,
    MAX_HEADER_FRAME_LEN, MAX_PCPU_COST_FRAME_LEN, MAX_TASK_FRAME_LEN, MAX_VM_END_FRAME_LEN,
    PcpuCost, Record, Task, VmEnd, VmInfo, encode_end, encode_header, encode_pcpu_cost,
    encode_task, encode_vm_end, max_block_frame_len, max_end_frame_len,
};
use spin::{Mutex, Once};

/// Records per block.
pub const BLOCK: usize = 64;
const _: () = assert!(BLOCK <= MAX_BLOCK_RECORDS);

/// Most chain frames a block's records carry.
const BLOCK_FRAMES: usize = BLOCK * 2 * MAX_CHAIN_DEPTH;

/// Big enough for any frame the exporter writes.
const FRAME_BUF: usize = max(
    MAX_HEADER_FRAME_LEN,
    max(
        max_block_frame_len(BLOCK, BLOCK_FRAMES),
        max(
            max(max_end_frame_len(MAX_CPUS), MAX_TASK_FRAME_LEN),
            max(
                MAX_VM_END_FRAME_LEN,
                max(
                    MAX_PCPU_COST_FRAME_LEN,
                    max(
                        hvprof_samplelog::MAX_MAPPING_FRAME_LEN,
                        hvprof_samplelog::MAX_OUTPUT_FRAME_LEN,
                    ),
                ),
            ),
        ),
    ),
);

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

/// `export=end` keeps at most this many task changes per pCPU between flushes.
const TASKS_KEPT: usize = 16 * 1024;

/// What the exporter keeps for one pCPU.
struct CpuLog {
    encoder: BlockEncoder,
    /// Where this pCPU's frames are encoded.
    frame: &'static mut [u8],
    /// The next block's records and their chain frames.
    records: &'static mut [Record],
    frames: &'static mut [u64],
    /// `end` mode: ring slots waiting, a circular buffer (`head`, `len`): the slots in
    /// `[head, head + len)` (modulo its length) are written, the others may not be. It holds
    /// whole samples (a record and its frame slots), as the ring does.
    stored: &'static mut [MaybeUninit<Slot>],
    head: usize,
    len: usize,
    /// `end` mode: task changes waiting.
    tasks: &'static mut [Task],
    tasks_len: usize,
    /// Task changes lost: the task ring was full (counted by the ring) or, when there was no
    /// memory for the buffer, the buffer.
    task_drops: u64,
    /// `end` mode: synchronous flushes of a full buffer, and their TSC ticks.
    flushes: u64,
    flush_ticks: u64,
    /// `end` mode: early sends of a full task store (their ticks are in `flush_ticks`).
    task_flushes: u64,
    /// TSC ticks spent exporting on this pCPU (draining, encoding, sending, flushing).
    export_ticks: u64,
    bytes_sent: u64,
}

/// What the exporter keeps.
struct Exporter {
    mode: Export,
    channel: Channel,
    header: Header,
    header_sent: Once<()>,
    cpus: Vec<Mutex<CpuLog>>,
}

static EXPORTER: Once<Exporter> = Once::new();

/// One VM as the header describes it.
pub struct VmEntry<'a> {
    pub name: &'a str,
    pub vcpus: u16,
    pub image: &'a str,
    pub build_id: &'a [u8],
}

/// Sets up the exporter; in `stream` mode the header goes out at once.
#[allow(clippy::too_many_arguments)]
pub fn init(
    mode: Export,
    channel: Channel,
    build_id: &[u8],
    tsc_hz: u64,
    pcpus: u16,
    tsc_skew: u64,
    period: u64,
    pmu: bool,
    buffer: u32,
    vms: &[VmEntry],
) {
    let mut header = Header {
        build_id: BuildId::new(build_id).unwrap_or_default(),
        tsc_hz,
        pcpus,
        tsc_skew,
        period_ticks: period,
        source: if pmu {
            hvprof_samplelog::SOURCE_PMU
        } else {
            hvprof_samplelog::SOURCE_DEADLINE
        },
        ..Header::default()
    };
    for (id, vm) in vms.iter().enumerate() {
        let _ = header.vms.push(VmInfo {
            id: id as u16,
            name: FixedStr::truncated(vm.name),
            vcpus: vm.vcpus,
            image: FixedStr::truncated(vm.image),
            image_build_id: BuildId::new(vm.build_id).unwrap_or_default(),
        });
    }
    let channel = open_channel(channel, "profiler");
    // `end` mode: `buffer=` records in all, or half of the memory still free, shared equally
    // between the pCPUs; never less than a few blocks (a full buffer is flushed, not dropped).
    let size = core::mem::size_of::<Slot>() as u64;
    let n = u64::from(pcpus.max(1));
    let per_cpu = match (mode, buffer) {
        (Export::Stream, _) => 0,
        (Export::End, 0) => memory::free_bytes() / 2 / size / n,
        (Export::End, b) => u64::from(b) / n,
    }
    .max(if mode == Export::End {
        4 * BLOCK as u64
    } else {
        0
    });
    let tasks = if mode == Export::End { TASKS_KEPT } else { 0 };
    let cpus = (0..pcpus.max(1))
        .map(|cpu| {
            Mutex::new(CpuLog {
                encoder: BlockEncoder::new(cpu, period),
                frame: alloc_slice::<u8>(FRAME_BUF as u64),
                records: alloc_slice::<Record>(BLOCK as u64),
                frames: alloc_slice::<u64>(BLOCK_FRAMES as u64),
                stored: alloc_uninit_slice::<Slot>(per_cpu),
                head: 0,
                len: 0,
                tasks: alloc_slice::<Task>(tasks as u64),
                tasks_len: 0,
                task_drops: 0,
                flushes: 0,
                flush_ticks: 0,
                task_flushes: 0,
                export_ticks: 0,
                bytes_sent: 0,
            })
        })
        .collect::<Vec<_>>();
    let stored: u64 = cpus.iter().map(|c| c.lock().stored.len() as u64).sum();
    println!(
        "profiler: export={mode} channel={channel} ({}), blocks of {BLOCK} records",
        match mode {
            Export::Stream => alloc::string::String::from("framed blocks during the run"),
            Export::End => alloc::format!(
                "{stored} records kept in memory ({} per pCPU, {} KiB each), sent at the end; a full buffer is flushed during the run",
                stored / n,
                stored / n * size / 1024
            ),
        }
    );
    let ex = EXPORTER.call_once(|| Exporter {
        mode,
        channel,
        header,
        header_sent: Once::new(),
        cpus,
    });
    if mode == Export::Stream
        && let Some(log) = ex.cpus.first()
    {
        ex.send_header(&mut log.lock());
    }
}

/// A zeroed slice of `count` values from the frame allocator, for the life of the machine (empty
/// if there is no memory).
fn alloc_slice<T>(count: u64) -> &'static mut [T] {
    if count == 0 {
        return &mut [];
    }
    let bytes = count.saturating_mul(core::mem::size_of::<T>() as u64);
    match memory::alloc_zeroed(bytes, 4096) {
        // SAFETY: fresh zeroed memory for `count` values, aligned to a page (more than any `T`
        // here needs), owned by the exporter for the life of the machine. It is used only for
        // `u8`, `u64`, `Record` and `Task`, for which all-zero bytes are
        // valid values (integers, fixed strings of length 0, and for `Record` the
        // sample variant, tag 0, of all-zero fields: the `Chain` byte 0 is a complete chain of
        // no frames, and the kinds are `#[repr(u8)]` enums whose 0 is a variant).
        Some(addr) => unsafe { core::slice::from_raw_parts_mut(addr as *mut T, count as usize) },
        None => &mut [],
    }
}

/// A slice of `count` values not yet written, from the frame allocator, for the life of the
/// machine (empty if there is no memory): not zeroed, as its size is most of the machine's
/// memory.
fn alloc_uninit_slice<T>(count: u64) -> &'static mut [MaybeUninit<T>] {
    if count == 0 {
        return &mut [];
    }
    let bytes = count.saturating_mul(core::mem::size_of::<T>() as u64);
    match memory::alloc_uninit(bytes, 4096) {
        // SAFETY: fresh memory for `count` values, aligned to a page (more than any `T` here
        // needs), owned by the exporter for the life of the machine; any bytes are a valid
        // `MaybeUninit<T>`.
        Some(addr) => unsafe {
            core::slice::from_raw_parts_mut(addr as *mut MaybeUninit<T>, count as usize)
        },
        None => &mut [],
    }
}

/// The channel the log can go on: `wanted`, or the serial console (with a warning line that
/// starts with `who`) when its device does not answer.
pub fn open_channel(wanted: Channel, who: &str) -> Channel {
    let missing = match wanted {
        Channel::Lpt if !parallel::init() => {
            alloc::string::String::from("no parallel port answers at 0x378")
        }
        Channel::Virtio => match virtio_console::init() {
            found @ virtio_console::Found::Ready { .. } => {
                println!("{who}: channel=virtio: {}", found.describe());
                return Channel::Virtio;
            }
            other => other.describe(),
        },
        c => return c,
    };
    println!(
        "{who}: warning: channel={wanted}: {missing}; the sample log goes to the serial console instead"
    );
    Channel::Serial
}

/// Writes one frame on `channel` (on the console with a line break after it, so the console
/// text after it starts a fresh line: the decoder returns the break as text, between frames);
/// returns the bytes written. The virtio console keeps it until a buffer fills or
/// `virtio_console::flush`.
pub fn put_frame(channel: Channel, frame: &[u8]) -> u64 {
    match channel {
        Channel::Serial => {
            console::write_raw(frame);
            console::write_raw(b"\r\n");
            frame.len() as u64 + 2
        }
        Channel::Lpt => {
            parallel::write(frame);
            frame.len() as u64
        }
        Channel::Virtio => {
            virtio_console::write(frame);
            frame.len() as u64
        }
    }
}

impl Exporter {
    /// Sends the first `len` bytes of `log.frame`.
    fn send(&self, log: &mut CpuLog, len: usize) {
        log.bytes_sent += put_frame(self.channel, &log.frame[..len]);
        if self.channel == Channel::Virtio {
            // Out at once: a frame is whole, and the log should leave as it is made.
            virtio_console::flush();
        }
    }

    /// Sends the header once, before the first block or task frame of any pCPU.
    fn send_header(&self, log: &mut CpuLog) {
        self.header_sent.call_once(|| {
            if let Ok(n) = encode_header(&self.header, log.frame) {
                self.send(log, n);
            }
        });
    }

    fn send_task(&self, log: &mut CpuLog, t: &Task) {
        self.send_header(log);
        if let Ok(n) = encode_task(t, log.frame) {
            self.send(log, n);
        }
    }

    /// Encodes and sends the block `fill_block` made in `log.records` and `log.frames`.
    fn send_block(&self, log: &mut CpuLog, block: Block) {
        let (n, frames, drops) = (block.records, block.frames, block.drops);
        if n == 0 {
            return;
        }
        self.send_header(log);
        let CpuLog {
            encoder,
            frame,
            records,
            frames: chain_frames,
            ..
        } = &mut *log;
        if let Ok(len) = encoder.encode(&records[..n], &chain_frames[..frames], drops, frame) {
            self.send(log, len);
        }
    }

    /// `end` mode: sends the stored task changes, then stored blocks until at most `keep` slots
    /// are left, moving the ring's new records in behind as room appears.
    fn flush(&self, log: &mut CpuLog, p: &CpuProfiler, keep: usize) {
        self.send_tasks(log, p);
        let cap = log.stored.len();
        while log.len > keep {
            let len = log.len;
            let block = {
                let CpuLog {
                    stored,
                    head,
                    records,
                    frames,
                    ..
                } = &mut *log;
                let (stored, head) = (&**stored, *head);
                fill_block(
                    |i| {
                        // SAFETY: `i < len`, and the slots in [head, head + len) were written by
                        // `move_ring` before `len` grew over them (the buffer's invariant, kept by
                        // `move_ring` and `flush`).
                        (i < len).then(|| unsafe { stored[(head + i) % cap].assume_init() })
                    },
                    &mut records[..BLOCK],
                    frames,
                )
            };
            let (taken, made) = block;
            if taken == 0 {
                break;
            }
            log.head = (log.head + taken) % cap;
            log.len -= taken;
            self.send_block(log, made);
            move_ring(log, p);
        }
    }

    /// `end` mode: sends the stored task changes (they carry their own TSC, so they need not
    /// come with the blocks of their time), moving the ring's new records into the stored buffer
    /// between frames: the samples taken meanwhile are kept, not dropped.
    fn send_tasks(&self, log: &mut CpuLog, p: &CpuProfiler) {
        for i in 0..log.tasks_len {
            let t = log.tasks[i];
            self.send_task(log, &t);
            move_ring(log, p);
        }
        log.tasks_len = 0;
    }
}

/// Runs a synchronous send of the stored log with interrupts off: the LAPIC timer's samples of
/// it would go into the buffer being emptied, and where a record costs more to send than a
/// sampling period, the send would feed itself forever and the guests would never run again. The
/// time is the profiler's cost (counted by the caller); the next deadline takes one sample.
fn without_sampling<R>(f: impl FnOnce() -> R) -> R {
    x86_64::instructions::interrupts::without_interrupts(f)
}

/// `end` mode: moves whole samples (a record and its frame slots) from the ring into the stored
/// buffer while it has room for them: everything waiting in one bulk copy when it fits (the
/// ring holds whole samples), else sample by sample. Returns whether it stopped for want of
/// room (what a sample taken meanwhile adds to the ring waits for the next drain: the buffer is
/// not full for it).
fn move_ring(log: &mut CpuLog, p: &CpuProfiler) -> bool {
    let cap = log.stored.len();
    let waiting = p.ring().waiting();
    let room = cap - log.len;
    let take = if waiting.len() <= room {
        waiting.len()
    } else {
        // The whole samples that fit.
        let mut i = 0;
        while let Some(first) = waiting.get(i) {
            let k = 1 + frame_slots(&first);
            if i + k > room || i + k > waiting.len() {
                break;
            }
            i += k;
        }
        i
    };
    // Into the stored circle: up to its end, then from its start.
    let at = (log.head + log.len) % cap;
    let first = take.min(cap - at);
    waiting.copy_into(0, &mut log.stored[at..at + first]);
    waiting.copy_into(first, &mut log.stored[..take - first]);
    log.len += take;
    p.ring().advance(take);
    take < waiting.len()
}

/// Whether `drain_if_full` has work: a block's worth of records, or a task change.
pub fn wants_drain(p: &CpuProfiler) -> bool {
    p.ring().len() >= BLOCK || !p.tasks().is_empty()
}

/// Called by the run loop after each exit (and by the scheduler and the idle loop): moves what the
/// ring holds on (`end`), or sends a block when one is full (`stream`); task changes go on at
/// once. Returns the TSC ticks it took.
pub fn drain_if_full(p: &CpuProfiler) -> u64 {
    if wants_drain(p) && !over_export_share(p) {
        drain(p, false)
    } else {
        0
    }
}

/// `stream` mode: whether the export has taken more than half of this pCPU's time since
/// sampling began. Then it waits, and the guests run: on a channel slower than the samples come
/// (a short period on the serial line), sending would otherwise take all the time, the more so
/// as the sending is itself sampled. The ring fills meanwhile and counts its drops, which the log
/// and the console report.
fn over_export_share(p: &CpuProfiler) -> bool {
    let stream = EXPORTER.get().is_some_and(|ex| ex.mode == Export::Stream);
    stream && p.enabled() && p.costs.export.get().1.saturating_mul(2) > p.span()
}

fn drain(p: &CpuProfiler, all: bool) -> u64 {
    let Some(ex) = EXPORTER.get() else {
        return 0;
    };
    let Some(cell) = ex.cpus.get(p.pcpu()) else {
        return 0;
    };
    let t0 = rdtsc();
    let mut guard = cell.lock();
    let log = &mut *guard;
    while let Some(t) = p.tasks().pop() {
        match ex.mode {
            Export::Stream => ex.send_task(log, &t),
            Export::End if log.tasks.is_empty() => log.task_drops += 1,
            Export::End => {
                if log.tasks_len == log.tasks.len() {
                    let t = rdtsc();
                    without_sampling(|| ex.send_tasks(log, p));
                    log.task_flushes += 1;
                    log.flush_ticks += rdtsc() - t;
                }
                log.tasks[log.tasks_len] = t;
                log.tasks_len += 1;
            }
        }
    }
    match ex.mode {
        Export::End => loop {
            // Only a buffer that lacked the room is full: a sample the timer took during the
            // move (this runs with interrupts on) is no reason to send half of it.
            if !move_ring(log, p) || log.stored.is_empty() {
                break;
            }
            // Full: send the older half now rather than lose what comes next.
            let t = rdtsc();
            let keep = log.stored.len() / 2;
            without_sampling(|| ex.flush(log, p, keep));
            log.flushes += 1;
            log.flush_ticks += rdtsc() - t;
        },
        Export::Stream => {
            // During the run, a drain sends what was waiting when it began, not what its own
            // sending adds: where a block takes longer to send than its records took to sample
            // (a short period on a slow channel), the samples of the sending would otherwise keep
            // it going forever and the guests would never run again. What is left waits for the
            // next drain; a ring that fills counts its drops.
            let mut budget = if all { usize::MAX } else { p.ring().len() };
            loop {
                if !all && (p.ring().len() < BLOCK || budget == 0) {
                    break;
                }
                let waiting = p.ring().waiting();
                let (taken, made) =
                    fill_block(|i| waiting.get(i), &mut log.records[..BLOCK], log.frames);
                if taken == 0 {
                    break;
                }
                p.ring().advance(taken);
                budget = budget.saturating_sub(taken);
                ex.send_block(log, made);
            }
        }
    }
    let ticks = rdtsc() - t0;
    log.export_ticks += ticks;
    // The export after the run (`finish`) is not part of the run's cost.
    if p.enabled() {
        p.costs.export.add(ticks);
    }
    ticks
}

/// Records taken over the whole run, all pCPUs (for the closing lines).
static RECORDS_TAKEN: AtomicU64 = AtomicU64::new(0);

/// After the run, once every pCPU has stopped sampling: sends the VM end frame of a stopped VM
/// (its exit statistics, IA32_LSTAR and task offsets), on the boot CPU's log.
pub fn send_vm_end(v: &VmEnd) {
    send_at_end(|frame| encode_vm_end(v, frame));
}

/// After the run: sends a mapping frame (a guest process's executable file mapping or a kernel
/// module), on the boot CPU's log.
pub fn send_mapping(m: &hvprof_samplelog::Mapping) {
    send_at_end(|frame| hvprof_samplelog::encode_mapping(m, frame));
}

/// After the run: sends an output frame (bytes a VM's program handed over through the output
/// port, or how many were lost), on the boot CPU's log.
pub fn send_output(o: &hvprof_samplelog::Output<'_>) {
    send_at_end(|frame| hvprof_samplelog::encode_output(o, frame));
}

/// Sends one frame `encode` writes into the boot CPU's frame buffer, after the header.
fn send_at_end(encode: impl FnOnce(&mut [u8]) -> Result<usize, hvprof_samplelog::EncodeError>) {
    let Some(ex) = EXPORTER.get() else {
        return;
    };
    let Some(cell) = ex.cpus.first() else {
        return;
    };
    let mut log = cell.lock();
    ex.send_header(&mut log);
    if let Ok(n) = encode(log.frame) {
        ex.send(&mut log, n);
    }
}

/// After the run, once every pCPU has stopped sampling: the rest of each ring, then (in `end`
/// mode) every stored task change and block, then each pCPU's cost frame, then the end frame
/// with each pCPU's totals.
pub fn finish() {
    let Some(ex) = EXPORTER.get() else {
        return;
    };
    let pcpus = ex.cpus.len();
    for cpu in 0..pcpus {
        let p = sampler::cpu(cpu);
        let _ = drain(p, true);
        if ex.mode == Export::End {
            // The normal end-of-run export (not counted as a flush of a full buffer).
            ex.flush(&mut ex.cpus[cpu].lock(), p, 0);
        }
        RECORDS_TAKEN.fetch_add(p.ring().pushed() + p.ring().dropped(), Ordering::Relaxed);
    }
    let totals: Vec<_> = (0..pcpus)
        .map(|cpu| {
            ex.cpus[cpu]
                .lock()
                .encoder
                .totals(sampler::cpu(cpu).ring().dropped())
        })
        .collect();
    let costs: Vec<PcpuCost> = (0..pcpus)
        .map(|cpu| sampler::cpu(cpu).cost_report())
        .collect();
    {
        let mut log = ex.cpus[0].lock();
        ex.send_header(&mut log);
        for c in &costs {
            if let Ok(n) = encode_pcpu_cost(c, log.frame) {
                ex.send(&mut log, n);
            }
        }
        if let Ok(n) = encode_end(&totals, log.frame) {
            ex.send(&mut log, n);
        }
    }
    report(ex, &totals);
    report_costs(&costs);
}

/// The profiler's whole cost on each pCPU, as a share of the time it sampled, in disjoint parts:
/// the exits that exist only to take samples, the LAPIC timer's interrupts, the other samples'
/// sample path and task reads, and the export. Samples cannot see most of it: a sampling exit
/// begins with its sample and ends a period before the next one.
fn report_costs(costs: &[PcpuCost]) {
    let mut total = (0u64, 0u64);
    for c in costs {
        let cpu = c.pcpu;
        let span = c.span_ticks.max(1);
        let pct = |t: u64| t as f64 * 100.0 / span as f64;
        println!(
            "profiler: pCPU {cpu} cost: {:.2}% of {span} ticks ({} samples): {} sampling exits x {} ticks ({:.2}%), {} timer interrupts x {} ticks ({:.2}%), other samples {} ticks ({:.2}%), export {} ticks ({:.2}%); {} task reads x {} ticks",
            pct(c.whole()),
            c.samples,
            c.sampling_exits,
            c.sampling_exit_ticks
                .checked_div(c.sampling_exits)
                .unwrap_or(0),
            pct(c.sampling_exit_ticks),
            c.timer_interrupts,
            c.timer_ticks.checked_div(c.timer_interrupts).unwrap_or(0),
            pct(c.timer_ticks),
            c.other_sample_ticks,
            pct(c.other_sample_ticks),
            c.export_ticks,
            pct(c.export_ticks),
            c.task_reads,
            c.task_read_ticks.checked_div(c.task_reads).unwrap_or(0),
        );
        total.0 += c.whole();
        total.1 += span;
    }
    println!(
        "profiler: whole cost {:.2}% of the pCPUs' time ({} of {} ticks)",
        total.0 as f64 * 100.0 / total.1.max(1) as f64,
        total.0,
        total.1
    );
}

/// The closing line on call chains (when `stacks=` asked for them): how deep they were and what
/// walking them cost, at guest samples and at hypervisor samples.
fn report_chains(pcpus: usize) {
    let total = |part: fn(&sampler::Costs) -> (&sampler::Tally, &AtomicU64)| {
        (0..pcpus).fold((0, 0, 0), |(n, t, f), cpu| {
            let (walks, frames) = part(&sampler::cpu(cpu).costs);
            let (count, ticks) = walks.get();
            (n + count, t + ticks, f + frames.load(Ordering::Relaxed))
        })
    };
    let guest = total(|c| (&c.guest_walks, &c.guest_frames));
    let host = total(|c| (&c.host_walks, &c.host_frames));
    if guest.0 + host.0 == 0 {
        return;
    }
    let mean = |(n, ticks, frames): (u64, u64, u64)| {
        alloc::format!(
            "{n} samples, mean {:.1} frames, mean {} TSC ticks",
            frames as f64 / n.max(1) as f64,
            ticks / n.max(1)
        )
    };
    let sum = |f: fn(&sampler::Costs) -> &AtomicU64| -> u64 {
        (0..pcpus)
            .map(|cpu| f(&sampler::cpu(cpu).costs).load(Ordering::Relaxed))
            .sum()
    };
    let stretched = sum(|c| &c.stretched);
    println!(
        "profiler: call chains walked (inside the sample path's cost): guest samples: {}; hypervisor samples (own and exit-cause chains): {}; {stretched} samples took over half a period (the next deadline moved to half a period after them)",
        mean(guest),
        mean(host),
    );
    let (orc_hits, orc_searches) = (sum(|c| &c.orc_hits), sum(|c| &c.orc_searches));
    println!(
        "profiler: call-chain reads: {} guest pages not remembered (walked in the guest's page tables); unwind entries (kernel ORC and user tables) {orc_hits} remembered, {orc_searches} searched in the tables",
        sum(|c| &c.page_walks),
    );
    let budget = |f: fn(&sampler::Costs) -> &sampler::BudgetUse| {
        let (most, stopped) = (0..pcpus).fold((0, 0), |(m, s), cpu| {
            let b = f(&sampler::cpu(cpu).costs);
            (
                m.max(b.most.load(Ordering::Relaxed)),
                s + b.stopped.load(Ordering::Relaxed),
            )
        });
        let limit = f(&sampler::cpu(0).costs).limit;
        alloc::format!("at most {most} of {limit} reads in one walk, {stopped} walks stopped there")
    };
    println!(
        "profiler: read budgets of walks by unwind tables: kernel (ORC) {}; user {}",
        budget(|c| &c.kernel_walk_reads),
        budget(|c| &c.user_walk_reads),
    );
}

/// The closing lines on the console: what was sent and lost, per pCPU when several.
fn report(ex: &Exporter, totals: &[hvprof_samplelog::PcpuTotals]) {
    let pcpus = ex.cpus.len();
    let period = ex.header.period_ticks;
    let mut all = (0u64, 0u64, u64::MAX, 0u64); // samples, cost sum, min, max
    for cpu in 0..pcpus {
        let (n, mean, min, max) = sampler::cpu(cpu).cost();
        all.0 += n;
        all.1 += mean * n;
        all.2 = all.2.min(if n == 0 { u64::MAX } else { min });
        all.3 = all.3.max(max);
    }
    let sum = |f: fn(&hvprof_samplelog::PcpuTotals) -> u64| totals.iter().map(f).sum::<u64>();
    let sent: u64 = ex.cpus.iter().map(|c| c.lock().bytes_sent).sum();
    let mean = all.1.checked_div(all.0).unwrap_or(0);
    println!(
        "profiler: sample path cost over {} samples: mean {mean}, min {}, max {} TSC ticks ({:.2}% of the {period}-tick period)",
        all.0,
        if all.0 == 0 { 0 } else { all.2 },
        all.3,
        mean as f64 * 100.0 / period.max(1) as f64,
    );
    report_chains(pcpus);
    let records = sum(|t| t.samples + t.events);
    println!(
        "profiler: sample log sent: {} records taken, {} records dropped (ring full), {} samples and {} events in {} blocks, {sent} bytes ({:.2} bytes per record) on the {} channel",
        RECORDS_TAKEN.load(Ordering::Relaxed),
        sum(|t| t.ring_drops),
        sum(|t| t.samples),
        sum(|t| t.events),
        sum(|t| t.blocks),
        sent as f64 / records.max(1) as f64,
        ex.channel,
    );
    if ex.channel == Channel::Virtio {
        virtio_console::drain();
        let (_, lost) = virtio_console::counts();
        if lost > 0 || !virtio_console::healthy() {
            println!(
                "profiler: warning: {lost} bytes of the sample log were lost: the virtio console stopped taking buffers"
            );
        }
    }
    if ex.channel == Channel::Lpt && parallel::lost() > 0 {
        println!(
            "profiler: warning: {} bytes of the sample log were lost: the parallel port stopped taking bytes",
            parallel::lost()
        );
    }
    let flushes: u64 = ex.cpus.iter().map(|c| c.lock().flushes).sum();
    let task_flushes: u64 = ex.cpus.iter().map(|c| c.lock().task_flushes).sum();
    if flushes + task_flushes > 0 {
        let ticks: u64 = ex.cpus.iter().map(|c| c.lock().flush_ticks).sum();
        println!(
            "profiler: export=end buffer full {flushes} times (records) and {task_flushes} times (task changes): sent during the run, {ticks} TSC ticks (counted in the profiler's cost)"
        );
    }
    let task_drops: u64 = (0..pcpus)
        .map(|c| sampler::cpu(c).tasks().dropped() + ex.cpus[c].lock().task_drops)
        .sum();
    let tasks: u64 = (0..pcpus).map(|c| sampler::cpu(c).tasks().pushed()).sum();
    if tasks + task_drops > 0 {
        println!(
            "profiler: guest task changes: {tasks} recorded, {task_drops} dropped (task ring full)"
        );
    }
    if pcpus > 1 {
        for cpu in 0..pcpus {
            let p = sampler::cpu(cpu);
            println!(
                "hvprof: pCPU {cpu}: {} kicks taken, {} sent (interrupts between pCPUs for the vCPUs' IPIs)",
                p.kicks.interrupts_taken(),
                p.kicks_sent.load(Ordering::Relaxed)
            );
        }
        for (cpu, t) in totals.iter().enumerate() {
            let p = sampler::cpu(cpu);
            let (n, mean, min, max) = p.cost();
            println!(
                "profiler: pCPU {cpu}: {} records taken, {} dropped, {} samples and {} events in {} blocks; sample path mean {mean}, min {min}, max {max} ticks over {n} samples",
                p.ring().pushed() + p.ring().dropped(),
                t.ring_drops,
                t.samples,
                t.events,
                t.blocks
            );
        }
    }
}
