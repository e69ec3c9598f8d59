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
use crate::{console, memory, println};
use core::sync::atomic::{AtomicU64, Ordering};
use hvprof_boot::cmdline::Export;
use hvprof_samplelog::{
    BlockEncoder, BuildId, Event, EventKind, FixedStr, Header, MAX_BLOCK_RECORDS,
    MAX_HEADER_FRAME_LEN, OutReason, Record, Sample, SampleKind, VmInfo, encode_end, encode_header,
    max_block_frame_len, max_end_frame_len,
};
use spin::Mutex;

/// Records per block.
pub const BLOCK: usize = 64;
const _: () = assert!(BLOCK <= MAX_BLOCK_RECORDS);

/// What the exporter keeps (one pCPU's worth; SMP extends it per pCPU).
struct Exporter {
    mode: Export,
    header: Header,
    encoder: BlockEncoder,
    /// `end` mode: raw records waiting for the end.
    stored: &'static mut [RawRecord],
    stored_len: usize,
    frame: [u8; FRAME_BUF],
    bytes_sent: u64,
}

/// Big enough for any frame the exporter writes.
const FRAME_BUF: usize = max(
    MAX_HEADER_FRAME_LEN,
    max(max_block_frame_len(BLOCK), max_end_frame_len(1)),
);

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

static EXPORTER: Mutex<Option<Exporter>> = Mutex::new(None);
/// Records lost because the `end` buffer was full (added to the ring drops in the log).
static BUFFER_DROPS: AtomicU64 = AtomicU64::new(0);

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
    let stored: &'static mut [RawRecord] = match mode {
        Export::Stream => &mut [],
        Export::End => {
            // `buffer=` records, or a quarter of the free memory, at most 1 M records.
            let size = core::mem::size_of::<RawRecord>() as u64;
            let records = match buffer {
                0 => (memory::free_bytes() / 4 / size).min(1 << 20),
                n => n as u64,
            };
            match memory::alloc_zeroed(records * core::mem::size_of::<RawRecord>() as u64, 4096) {
                // SAFETY: fresh zeroed memory for `records` records, owned by the exporter for
                // the life of the machine. All-zero bytes are a valid RawRecord (integers and a
                // `Kind` whose discriminant 0 is `Guest`).
                Some(addr) => unsafe {
                    core::slice::from_raw_parts_mut(addr as *mut RawRecord, records as usize)
                },
                None => &mut [],
            }
        }
    };
    println!(
        "profiler: export={} ({}), blocks of {BLOCK} records",
        match mode {
            Export::Stream => "stream",
            Export::End => "end",
        },
        match mode {
            Export::Stream =>
                alloc::string::String::from("framed blocks on the serial line during the run"),
            Export::End =>
                alloc::format!("{} records kept in memory, sent at the end", stored.len()),
        }
    );
    let mut ex = Exporter {
        mode,
        header,
        encoder: BlockEncoder::new(0, period),
        stored,
        stored_len: 0,
        frame: [0; FRAME_BUF],
        bytes_sent: 0,
    };
    if mode == Export::Stream {
        ex.send_header();
    }
    *EXPORTER.lock() = Some(ex);
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

    fn send_block(&mut self, records: &[RawRecord], drops: u64) {
        let mut converted = [Record::Sample(Sample::default()); BLOCK];
        for (slot, r) in converted.iter_mut().zip(records) {
            *slot = convert(r);
        }
        if let Ok(n) = self
            .encoder
            .encode(&converted[..records.len()], drops, &mut self.frame)
        {
            self.send(n);
        }
    }
}

fn drops(p: &CpuProfiler) -> u64 {
    p.ring.dropped() + BUFFER_DROPS.load(Ordering::Relaxed)
}

/// Called by the run loop after each exit: moves what the ring holds on (`end`), or sends a block
/// when one is full (`stream`).
pub fn drain_if_full(p: &CpuProfiler) {
    if p.ring.len() < BLOCK {
        return;
    }
    drain(p, false);
}

fn drain(p: &CpuProfiler, all: bool) {
    let mut guard = EXPORTER.lock();
    let Some(ex) = guard.as_mut() else {
        return;
    };
    match ex.mode {
        Export::End => {
            while let Some(r) = p.ring.pop() {
                if ex.stored_len < ex.stored.len() {
                    ex.stored[ex.stored_len] = r;
                    ex.stored_len += 1;
                } else {
                    BUFFER_DROPS.fetch_add(1, Ordering::Relaxed);
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
            let d = drops(p);
            ex.send_block(&block[..n], d);
        },
    }
}

/// After the run: the rest of the ring, then (in `end` mode) the header and every stored block,
/// then the end frame with the totals.
pub fn finish(p: &CpuProfiler) {
    drain(p, true);
    let mut guard = EXPORTER.lock();
    let Some(ex) = guard.as_mut() else {
        return;
    };
    if ex.mode == Export::End {
        ex.send_header();
        let mut at = 0;
        let d = drops(p);
        let mut chunk = [RawRecord::ZERO; BLOCK];
        while at < ex.stored_len {
            let n = (ex.stored_len - at).min(BLOCK);
            chunk[..n].copy_from_slice(&ex.stored[at..at + n]);
            ex.send_block(&chunk[..n], d);
            at += n;
        }
    }
    let totals = [ex.encoder.totals(drops(p))];
    if let Ok(n) = encode_end(&totals, &mut ex.frame) {
        ex.send(n);
    }
    let sent = ex.bytes_sent;
    let period = ex.header.period_ticks;
    let t = totals[0];
    drop(guard);
    let taken = p.ring.pushed() + p.ring.dropped();
    let (n, mean, min, max) = p.cost();
    println!(
        "profiler: sample path cost over {n} samples: mean {mean}, min {min}, max {max} TSC ticks ({:.2}% of the {}-tick period)",
        mean as f64 * 100.0 / period.max(1) as f64,
        period
    );
    println!(
        "profiler: sample log sent: {taken} records taken, {} records dropped (ring or buffer full), {} samples and {} events in {} blocks, {sent} bytes ({:.2} bytes per record)",
        t.ring_drops,
        t.samples,
        t.events,
        t.blocks,
        sent as f64 / (t.samples + t.events).max(1) as f64
    );
}
