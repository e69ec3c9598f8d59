//! Export of the sample log, outside the sample path: the rings are drained into framed,
//! checksummed, delta-encoded blocks (`hvprof-samplelog`, the one definition of the wire format)
//! on the serial line, interleaved with console text.
//!
//! Two modes (`export=` boot option):
//! - `stream`: a block is encoded and sent whenever a ring holds one, during the run. The cost of
//!   encoding and sending shows in the profile as hypervisor time, as it should.
//! - `end`: records are moved from the ring into a large in-memory buffer during the run (a copy,
//!   no encoding) and everything is encoded and sent when the VMs have stopped. For slow links
//!   (and Bochs, where the UART costs hundreds of instructions per byte).
//!
//! A record that finds the ring full is counted as a ring drop; in `end` mode a record that finds
//! the buffer full is counted the same way, so the log always says exactly what it lacks.

use super::{CpuProfiler, Kind, RawRecord};
use crate::percpu::MAX_CPUS;
use crate::{console, memory, println};
use hvprof_boot::cmdline::Export;
use hvprof_samplelog::{
    BlockEncoder, BuildId, Event, EventKind, FixedStr, Header, MAX_BLOCK_RECORDS,
    MAX_HEADER_FRAME_LEN, MAX_TASK_FRAME_LEN, OutReason, Record, Sample, SampleKind, Task, VmInfo,
    encode_end, encode_header, encode_task, max_block_frame_len, max_end_frame_len,
};
use spin::Mutex;

/// Records per block.
pub const BLOCK: usize = 64;
const _: () = assert!(BLOCK <= MAX_BLOCK_RECORDS);

/// What the exporter keeps for one pCPU.
struct CpuLog {
    encoder: BlockEncoder,
    /// `end` mode: raw records waiting for the end.
    stored: &'static mut [RawRecord],
    stored_len: usize,
    /// Records lost because `stored` was full (added to the ring drops in the log).
    buffer_drops: u64,
    /// `end` mode: task changes waiting for the end.
    tasks: alloc::vec::Vec<Task>,
}

/// `end` mode keeps at most this many task changes per pCPU (a guest switching tasks at every
/// sample for a whole run would need more; the rest are counted as dropped).
const TASKS_KEPT: usize = 1 << 16;
/// Task changes lost (task ring or `end` buffer full), all pCPUs.
static TASK_DROPS: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);

/// What the exporter keeps.
struct Exporter {
    mode: Export,
    header: Header,
    cpus: alloc::vec::Vec<CpuLog>,
    frame: [u8; FRAME_BUF],
    bytes_sent: u64,
}

/// Big enough for any frame the exporter writes.
const FRAME_BUF: usize = max(
    MAX_HEADER_FRAME_LEN,
    max(
        max_block_frame_len(BLOCK),
        max(max_end_frame_len(MAX_CPUS), MAX_TASK_FRAME_LEN),
    ),
);

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

static EXPORTER: Mutex<Option<Exporter>> = Mutex::new(None);

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
    // `end` mode: `buffer=` records in all, or a quarter of the free memory, at most 1 M records
    // per pCPU; shared equally between the pCPUs.
    let size = core::mem::size_of::<RawRecord>() as u64;
    let n = u64::from(pcpus.max(1));
    let per_cpu = match (mode, buffer) {
        (Export::Stream, _) => 0,
        (Export::End, 0) => (memory::free_bytes() / 4 / size / n).min(1 << 20),
        (Export::End, b) => u64::from(b) / n,
    };
    let cpus = (0..pcpus.max(1))
        .map(|cpu| CpuLog {
            encoder: BlockEncoder::new(cpu, period),
            stored: alloc_records(per_cpu),
            stored_len: 0,
            buffer_drops: 0,
            tasks: alloc::vec::Vec::new(),
        })
        .collect::<alloc::vec::Vec<_>>();
    let stored: u64 = cpus.iter().map(|c| c.stored.len() as u64).sum();
    println!(
        "profiler: export={} ({}), blocks of {BLOCK} records",
        match mode {
            Export::Stream => "stream",
            Export::End => "end",
        },
        match mode {
            Export::Stream =>
                alloc::string::String::from("framed blocks on the serial line during the run"),
            Export::End => alloc::format!(
                "{stored} records kept in memory ({per_cpu} per pCPU), sent at the end"
            ),
        }
    );
    let mut ex = Exporter {
        mode,
        header,
        cpus,
        frame: [0; FRAME_BUF],
        bytes_sent: 0,
    };
    if mode == Export::Stream {
        ex.send_header();
    }
    *EXPORTER.lock() = Some(ex);
}

/// A zeroed buffer of `records` records from the frame allocator (empty if there is no memory).
fn alloc_records(records: u64) -> &'static mut [RawRecord] {
    if records == 0 {
        return &mut [];
    }
    match memory::alloc_zeroed(records * core::mem::size_of::<RawRecord>() as u64, 4096) {
        // SAFETY: fresh zeroed memory for `records` records, owned by the exporter for the life
        // of the machine. All-zero bytes are a valid RawRecord (integers and a `Kind` whose
        // discriminant 0 is `Guest`).
        Some(addr) => unsafe {
            core::slice::from_raw_parts_mut(addr as *mut RawRecord, records as usize)
        },
        None => &mut [],
    }
}

fn convert(r: &RawRecord) -> Record {
    match r.kind {
        Kind::Guest | Kind::Hypervisor | Kind::Idle => Record::Sample(Sample {
            tsc: r.tsc,
            kind: match r.kind {
                Kind::Guest => SampleKind::Guest,
                Kind::Hypervisor => SampleKind::Hypervisor,
                _ => SampleKind::Idle,
            },
            vm: r.vm,
            vcpu: r.vcpu,
            vpid: r.vpid,
            guest_rip: r.guest_rip,
            guest_cr3: r.guest_cr3,
            guest_mode: r.mode,
            exit_reason: r.exit_reason,
            host_rip: r.host_rip,
            cost: r.cost,
        }),
        Kind::VcpuIn | Kind::VcpuOut => Record::Event(Event {
            tsc: r.tsc,
            kind: if r.kind == Kind::VcpuIn {
                EventKind::VcpuIn
            } else {
                EventKind::VcpuOut
            },
            vm: r.vm,
            vcpu: r.vcpu,
            reason: match r.mode {
                super::OUT_PREEMPTED => OutReason::Preempted,
                super::OUT_HALTED => OutReason::Halted,
                _ => OutReason::Stopped,
            },
        }),
    }
}

impl Exporter {
    /// Sends one frame, then a line break so the console text after it starts a fresh line
    /// (the decoder returns the break as text, between frames).
    fn send(&mut self, len: usize) {
        console::write_raw(&self.frame[..len]);
        console::write_raw(b"\r\n");
        self.bytes_sent += len as u64 + 2;
    }

    fn send_header(&mut self) {
        if let Ok(n) = encode_header(&self.header, &mut self.frame) {
            self.send(n);
        }
    }

    fn send_task(&mut self, t: &Task) {
        if let Ok(n) = encode_task(t, &mut self.frame) {
            self.send(n);
        }
    }

    /// Encodes and sends one block of pCPU `cpu`'s records.
    fn send_block(&mut self, cpu: usize, records: &[RawRecord], drops: u64) {
        let mut converted = [Record::Sample(Sample::default()); BLOCK];
        for (slot, r) in converted.iter_mut().zip(records) {
            *slot = convert(r);
        }
        if let Ok(n) =
            self.cpus[cpu]
                .encoder
                .encode(&converted[..records.len()], drops, &mut self.frame)
        {
            self.send(n);
        }
    }
}

/// Records pCPU `cpu` lost so far: ring full, or (`end` mode) buffer full.
fn drops(ex: &Exporter, p: &CpuProfiler) -> u64 {
    p.ring.dropped() + ex.cpus.get(p.pcpu()).map_or(0, |c| c.buffer_drops)
}

/// Called by the run loop after each exit: moves what the ring holds on (`end`), or sends a block
/// when one is full (`stream`); task changes go on at once.
pub fn drain_if_full(p: &CpuProfiler) {
    if p.ring.len() < BLOCK && p.tasks.is_empty() {
        return;
    }
    drain(p, false);
}

fn drain(p: &CpuProfiler, all: bool) {
    let mut guard = EXPORTER.lock();
    let Some(ex) = guard.as_mut() else {
        return;
    };
    let cpu = p.pcpu();
    if cpu >= ex.cpus.len() {
        return;
    }
    while let Some(t) = p.tasks.pop() {
        match ex.mode {
            Export::Stream => ex.send_task(&t),
            Export::End if ex.cpus[cpu].tasks.len() < TASKS_KEPT => ex.cpus[cpu].tasks.push(t),
            Export::End => {
                TASK_DROPS.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
            }
        }
    }
    match ex.mode {
        Export::End => {
            let log = &mut ex.cpus[cpu];
            while let Some(r) = p.ring.pop() {
                if log.stored_len < log.stored.len() {
                    log.stored[log.stored_len] = r;
                    log.stored_len += 1;
                } else {
                    log.buffer_drops += 1;
                }
            }
        }
        Export::Stream => loop {
            if !all && p.ring.len() < BLOCK {
                break;
            }
            let mut block = [RawRecord::ZERO; BLOCK];
            let mut n = 0;
            while n < BLOCK {
                match p.ring.pop() {
                    Some(r) => {
                        block[n] = r;
                        n += 1;
                    }
                    None => break,
                }
            }
            if n == 0 {
                break;
            }
            let d = drops(ex, p);
            ex.send_block(cpu, &block[..n], d);
        },
    }
}

/// After the run, once every pCPU has stopped sampling: the rest of each ring, then (in `end`
/// mode) the header and every stored block, then the end frame with each pCPU's totals.
pub fn finish() {
    let pcpus = EXPORTER.lock().as_ref().map_or(0, |ex| ex.cpus.len());
    for cpu in 0..pcpus {
        drain(super::cpu(cpu), true);
    }
    let mut guard = EXPORTER.lock();
    let Some(ex) = guard.as_mut() else {
        return;
    };
    if ex.mode == Export::End {
        ex.send_header();
        for cpu in 0..pcpus {
            for t in core::mem::take(&mut ex.cpus[cpu].tasks) {
                ex.send_task(&t);
            }
        }
        let mut chunk = [RawRecord::ZERO; BLOCK];
        for cpu in 0..pcpus {
            let d = drops(ex, super::cpu(cpu));
            let mut at = 0;
            while at < ex.cpus[cpu].stored_len {
                let n = (ex.cpus[cpu].stored_len - at).min(BLOCK);
                chunk[..n].copy_from_slice(&ex.cpus[cpu].stored[at..at + n]);
                ex.send_block(cpu, &chunk[..n], d);
                at += n;
            }
        }
    }
    let totals: alloc::vec::Vec<_> = (0..pcpus)
        .map(|cpu| ex.cpus[cpu].encoder.totals(drops(ex, super::cpu(cpu))))
        .collect();
    if let Ok(n) = encode_end(&totals, &mut ex.frame) {
        ex.send(n);
    }
    let sent = ex.bytes_sent;
    let period = ex.header.period_ticks;
    drop(guard);
    // The machine's totals (what the tests and benches read), then each pCPU's when several.
    let mut all = (0u64, 0u64, u64::MAX, 0u64, 0u64); // samples, cost sum, min, max, taken
    for cpu in 0..pcpus {
        let p = super::cpu(cpu);
        let (n, mean, min, max) = p.cost();
        all.0 += n;
        all.1 += mean * n;
        all.2 = all.2.min(if n == 0 { u64::MAX } else { min });
        all.3 = all.3.max(max);
        all.4 += p.ring.pushed() + p.ring.dropped();
    }
    let sum = |f: fn(&hvprof_samplelog::PcpuTotals) -> u64| totals.iter().map(f).sum::<u64>();
    let mean = all.1.checked_div(all.0).unwrap_or(0);
    println!(
        "profiler: sample path cost over {} samples: mean {mean}, min {}, max {} TSC ticks ({:.2}% of the {period}-tick period)",
        all.0,
        if all.0 == 0 { 0 } else { all.2 },
        all.3,
        mean as f64 * 100.0 / period.max(1) as f64,
    );
    let records = sum(|t| t.samples + t.events);
    println!(
        "profiler: sample log sent: {} records taken, {} records dropped (ring or buffer full), {} samples and {} events in {} blocks, {sent} bytes ({:.2} bytes per record)",
        all.4,
        sum(|t| t.ring_drops),
        sum(|t| t.samples),
        sum(|t| t.events),
        sum(|t| t.blocks),
        sent as f64 / records.max(1) as f64
    );
    let task_drops = TASK_DROPS.load(core::sync::atomic::Ordering::Relaxed)
        + (0..pcpus)
            .map(|c| super::cpu(c).tasks.dropped())
            .sum::<u64>();
    let tasks: u64 = (0..pcpus).map(|c| super::cpu(c).tasks.pushed()).sum();
    if tasks + task_drops > 0 {
        println!(
            "profiler: guest task changes: {tasks} recorded, {task_drops} dropped (task ring or buffer full)"
        );
    }
    if pcpus > 1 {
        for (cpu, t) in totals.iter().enumerate() {
            let p = super::cpu(cpu);
            let (n, mean, min, max) = p.cost();
            println!(
                "profiler: pCPU {cpu}: {} records taken, {} dropped, {} samples and {} events in {} blocks; sample path mean {mean}, min {min}, max {max} ticks over {n} samples",
                p.ring.pushed() + p.ring.dropped(),
                t.ring_drops,
                t.samples,
                t.events,
                t.blocks
            );
        }
    }
}
