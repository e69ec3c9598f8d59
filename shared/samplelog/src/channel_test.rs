//! The channel self-test's record stream (`selftest=channel`): every record is a pure function
//! of its pCPU and index, so the hypervisor sends them and the host makes them again and checks
//! a capture bit-exact. Shaped like a real log (a few VMs, hot functions, jittered periods, the
//! hypervisor's exits, idle time, scheduling events) so that its bytes per record are a real
//! log's.
//!
//! The stream: a header frame ([`header`]), then blocks of [`BLOCK_RECORDS`] records taking turns
//! across the [`PCPUS`] pCPUs (pCPU `p` sends [`records_of`]`(total, p)` records), then one pCPU
//! cost frame per pCPU (pCPU 0's `export_ticks` are the TSC ticks the sender spent in the
//! channel, `span_ticks` the whole test's), then the end frame.

use crate::{
    BlockEncoder, Event, EventKind, Header, MAX_HEADER_FRAME_LEN, OutReason, PcpuCost, PcpuTotals,
    Record, SOURCE_DEADLINE, Sample, SampleKind, encode_end, encode_header, encode_pcpu_cost,
    max_block_frame_len, max_end_frame_len,
};

/// pCPUs the stream is spread over.
pub const PCPUS: u16 = 4;
/// The nominal sampling period of its sample TSCs (1 ms at 2.4 GHz).
pub const PERIOD_TICKS: u64 = 2_400_000;
/// Records per block frame.
pub const BLOCK_RECORDS: usize = 64;

/// A 64-bit mix (the SplitMix64 finaliser): a different, well-spread value for every input.
const fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// How many of `total` records pCPU `pcpu` sends (an even split, the first pCPUs one more).
#[must_use]
pub const fn records_of(total: u64, pcpu: u16) -> u64 {
    let p = pcpu as u64;
    let n = PCPUS as u64;
    total / n + if p < total % n { 1 } else { 0 }
}

/// The header frame's content: the sender's TSC rate (its cost frame's ticks are in it; the
/// records' TSCs are synthetic), the stream's pCPUs and period; no VMs.
#[must_use]
pub fn header(build_id: &[u8], tsc_hz: u64) -> Header {
    Header {
        build_id: crate::BuildId::new(build_id).unwrap_or_default(),
        tsc_hz,
        pcpus: PCPUS,
        period_ticks: PERIOD_TICKS,
        source: SOURCE_DEADLINE,
        ..Header::default()
    }
}

/// Record `index` of pCPU `pcpu`.
#[must_use]
pub fn record(pcpu: u16, index: u64) -> Record {
    let h = mix((u64::from(pcpu) << 48) ^ index);
    // Strictly rising TSCs: the jitter is far below the period.
    let tsc = 1_000_000 + index * PERIOD_TICKS + (h % 20_000);
    let vm = pcpu % 3;
    let vcpu = pcpu / 3;
    if index % 97 == 96 {
        let out = (index / 97).is_multiple_of(2);
        return Record::Event(Event {
            tsc,
            kind: if out {
                EventKind::VcpuOut
            } else {
                EventKind::VcpuIn
            },
            vm,
            vcpu,
            reason: if out {
                OutReason::Preempted
            } else {
                OutReason::default()
            },
        });
    }
    let kind = match (h >> 56) % 20 {
        0..=16 => SampleKind::Guest,
        17 | 18 => SampleKind::Hypervisor,
        _ => SampleKind::Idle,
    };
    // Eight hot functions, 256 bytes each, in the guest's kernel and in its user program.
    let function = (h >> 8) % 8;
    let user = function >= 5;
    let base = if user {
        0x40_1000
    } else {
        0xffff_ffff_8100_0000
    };
    let guest_rip = base + function * 0x1000 + ((h >> 16) % 256);
    let guest = kind == SampleKind::Guest;
    Record::Sample(Sample {
        tsc,
        kind,
        vm: if kind == SampleKind::Idle {
            crate::NO_VM
        } else {
            vm
        },
        vcpu: if kind == SampleKind::Idle {
            crate::NO_VCPU
        } else {
            vcpu
        },
        vpid: if guest { vm + 1 } else { 0 },
        guest_rip: if guest { guest_rip } else { 0 },
        guest_cr3: if guest {
            0x10_0000 + (u64::from(vm) << 20) + ((h >> 24) % 4) * 0x1000
        } else {
            0
        },
        guest_mode: if guest {
            crate::guest_mode(if user { 3 } else { 0 }, 2)
        } else {
            0
        },
        exit_reason: if kind == SampleKind::Hypervisor {
            [1u16, 10, 30, 48, 52][((h >> 32) % 5) as usize]
        } else {
            0
        },
        host_rip: if guest {
            0
        } else {
            0xffff_8000_0020_0000 + ((h >> 36) % 0x4000)
        },
        cost: 200 + ((h >> 40) % 64) as u32,
        ..Sample::default()
    })
}

/// Where the stream goes: the hypervisor's channel (which times itself), or the host's copy
/// made to check a capture.
pub trait Sink {
    /// Sends one frame.
    fn frame(&mut self, frame: &[u8]);
    /// After the blocks: each pCPU's cost frame.
    fn costs(&mut self) -> [PcpuCost; PCPUS as usize];
}

/// The largest frame of the stream.
const FRAME: usize = {
    let a = max_block_frame_len(BLOCK_RECORDS, 0);
    let b = max_end_frame_len(PCPUS as usize);
    let m = if a > b { a } else { b };
    if m > MAX_HEADER_FRAME_LEN {
        m
    } else {
        MAX_HEADER_FRAME_LEN
    }
};

/// Sends the whole stream of `records` records (see the module comment) into `sink`.
pub fn send(records: u64, header: &Header, sink: &mut impl Sink) {
    let mut buf = [0u8; FRAME];
    if let Ok(n) = encode_header(header, &mut buf) {
        sink.frame(&buf[..n]);
    }
    let mut encoders: [BlockEncoder; PCPUS as usize] = core::array::from_fn(|p| {
        BlockEncoder::new(u16::try_from(p).unwrap_or(u16::MAX), PERIOD_TICKS)
    });
    let mut block = [Record::Sample(Sample::default()); BLOCK_RECORDS];
    let mut first = 0u64;
    while first < records_of(records, 0) {
        for p in 0..PCPUS {
            let end = records_of(records, p).min(first + BLOCK_RECORDS as u64);
            if first >= end {
                continue;
            }
            // At most BLOCK_RECORDS.
            let n = usize::try_from(end - first).unwrap_or(BLOCK_RECORDS);
            for (i, r) in block[..n].iter_mut().enumerate() {
                *r = record(p, first + i as u64);
            }
            if let Ok(len) = encoders[usize::from(p)].encode(&block[..n], &[], 0, &mut buf) {
                sink.frame(&buf[..len]);
            }
        }
        first += BLOCK_RECORDS as u64;
    }
    for cost in sink.costs() {
        if let Ok(n) = encode_pcpu_cost(&cost, &mut buf) {
            sink.frame(&buf[..n]);
        }
    }
    let totals: [PcpuTotals; PCPUS as usize] = core::array::from_fn(|p| encoders[p].totals(0));
    if let Ok(n) = encode_end(&totals, &mut buf) {
        sink.frame(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_covers_every_record() {
        for total in [0u64, 1, 3, 4, 5, 1_000_001] {
            let sum: u64 = (0..PCPUS).map(|p| records_of(total, p)).sum();
            assert_eq!(sum, total);
        }
    }

    #[test]
    fn records_are_a_function_of_pcpu_and_index_with_rising_tscs() {
        for p in 0..PCPUS {
            let mut last = 0;
            for i in 0..2000 {
                assert_eq!(record(p, i), record(p, i));
                let t = record(p, i).tsc();
                assert!(t > last);
                last = t;
            }
        }
        assert_ne!(record(0, 5), record(1, 5));
    }
}
