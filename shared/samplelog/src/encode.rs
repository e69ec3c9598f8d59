//! The encoder: complete frames (`0x00`, COBS(payload), `0x00`) into caller-provided buffers.
//! No allocation, no `std`; deterministic output.

use core::fmt;

use crate::bits::ByteWriter;
use crate::cobs;
use crate::codec;
use crate::stats::{
    EXIT_PORTS, EXIT_REASONS, HISTOGRAM_BUCKETS, MAX_SPIN_SITES, MAX_VPMU_VCPUS, PcpuCost, VmEnd,
};
use crate::types::{
    BUILD_ID_LEN, BlockHeader, COMM_LEN, Header, Mapping, Output, PATH_LEN, PcpuTotals, Record,
    Task,
};

/// The first three payload bytes of every frame.
pub const MAGIC: [u8; 3] = *b"HVP";
/// Frame type of the header frame.
pub const FRAME_HEADER: u8 = 1;
/// Frame type of a block frame.
pub const FRAME_BLOCK: u8 = 2;
/// Frame type of the end frame.
pub const FRAME_END: u8 = 3;
/// Frame type of a task frame.
pub const FRAME_TASK: u8 = 4;
/// Frame type of a VM end frame (a VM's exit statistics, LSTAR and task offsets).
pub const FRAME_VM_END: u8 = 5;
/// Frame type of a pCPU cost frame (the profiler's whole cost on one pCPU).
pub const FRAME_PCPU_COST: u8 = 6;
/// Frame type of a mapping frame (a guest process's executable file mapping, or a module).
pub const FRAME_MAPPING: u8 = 7;
/// Frame type of an output frame (bytes a guest program wrote, kept whole in the capture).
pub const FRAME_OUTPUT: u8 = 8;
/// Frame types up to this value are recognised as frames (unknown ones are reported, not decoded).
pub const MAX_FRAME_TYPE: u8 = 15;
/// Most bytes of guest output in one output frame.
pub const MAX_OUTPUT_CHUNK: usize = 1024;
/// Most records in one block frame.
pub const MAX_BLOCK_RECORDS: usize = 1024;
/// Most pCPU entries in one end frame.
pub const MAX_END_PCPUS: usize = 4096;

/// CRC-32C (Castagnoli; "CRC-32/ISCSI": reflected polynomial 0x82F63B78, initial value and final
/// XOR 0xFFFFFFFF; check value of `"123456789"` is 0xE3069283).
pub(crate) static CRC32C: crc::Crc<u32, crc::Table<16>> =
    crc::Crc::<u32, crc::Table<16>>::new(&crc::CRC_32_ISCSI);

/// CRC-32C of `data`, as the frames carry it.
#[must_use]
pub fn crc32c(data: &[u8]) -> u32 {
    CRC32C.checksum(data)
}

/// Why a frame could not be encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodeError {
    /// The output buffer is too small (size it with the `max_*_frame_len` functions).
    BufferTooSmall,
    /// More than `MAX_BLOCK_RECORDS` records for one block.
    TooManyRecords,
    /// More than `MAX_END_PCPUS` entries for the end frame.
    TooManyPcpus,
    /// The frame list's length is not the sum of the samples' chain depths.
    ChainFrames,
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EncodeError::BufferTooSmall => "output buffer too small for the frame",
            EncodeError::TooManyRecords => "too many records for one block",
            EncodeError::TooManyPcpus => "too many pCPUs for the end frame",
            EncodeError::ChainFrames => "the chain frames do not match the samples' chain depths",
        })
    }
}

impl core::error::Error for EncodeError {}

/// Buffer size that always holds the frame of a `payload_len`-byte payload with this encoder
/// (the encoder COBS-encodes in place, so it needs slightly more than the frame's final length).
#[must_use]
pub const fn frame_buffer_len(payload_len: usize) -> usize {
    payload_len + 3 + (payload_len + 3).div_ceil(253)
}

/// Longest block payload header: magic + type, seven varints, four Rice parameters, CRC.
const MAX_BLOCK_OVERHEAD: usize = 4 + (3 + 10 + 10 + 10 + 10 + 10 + 2) + codec::PARAMS_LEN + 4;

/// Buffer size that always holds a block frame of `records` records.
#[must_use]
pub const fn max_block_frame_len(records: usize, frames: usize) -> usize {
    frame_buffer_len(
        MAX_BLOCK_OVERHEAD
            + (records * (codec::MAX_RECORD_BITS + codec::MAX_CHAIN_BITS_PER_RECORD)
                + frames * codec::MAX_FRAME_BITS)
                .div_ceil(8),
    )
}

/// Buffer size that always holds a header frame.
pub const MAX_HEADER_FRAME_LEN: usize = frame_buffer_len(
    4 + 3 + 21 + 10 + 3 + 10 + 10 + 1 + 1 + crate::types::MAX_VMS * (3 + 33 + 3 + 65 + 21) + 4,
);

/// Buffer size that always holds an end frame of `pcpus` entries.
#[must_use]
pub const fn max_end_frame_len(pcpus: usize) -> usize {
    frame_buffer_len(4 + 3 + pcpus * (3 + 4 * 10) + 4)
}

/// Buffer size that always holds a VM end frame.
pub const MAX_VM_END_FRAME_LEN: usize = frame_buffer_len(
    4 + 3
        + 10
        + 1
        + 10
        + 3 * 5
        + 10
        + 1
        + EXIT_REASONS * (1 + 4 * 10 + 2 + HISTOGRAM_BUCKETS * 5)
        + 1
        + EXIT_PORTS * (3 + 10)
        + 10
        + 1
        + 5
        + 5
        + 1
        + MAX_SPIN_SITES * (3 + 10 + 10)
        + 10
        + 1
        + 1
        + MAX_VPMU_VCPUS * (3 + 8 * 10)
        + 1
        + 4,
);

/// Buffer size that always holds a pCPU cost frame.
pub const MAX_PCPU_COST_FRAME_LEN: usize = frame_buffer_len(4 + 3 + 10 * 10 + 4);

#[cfg(feature = "std")]
const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

/// No valid frame is longer than this on the wire (readers bound their work with it).
#[cfg(feature = "std")]
pub(crate) const MAX_FRAME_BYTES: usize = max(
    max(
        max(
            max_block_frame_len(MAX_BLOCK_RECORDS, 0),
            MAX_HEADER_FRAME_LEN,
        ),
        max_end_frame_len(MAX_END_PCPUS),
    ),
    MAX_VM_END_FRAME_LEN,
);

/// Builds one frame in `out`: the body writer gets the payload area after magic and type (and
/// before the CRC) and returns the body length.
fn write_frame(
    out: &mut [u8],
    frame_type: u8,
    body: impl FnOnce(&mut [u8]) -> Result<usize, EncodeError>,
) -> Result<usize, EncodeError> {
    let n = out.len();
    // The payload is built at `src`, then COBS-encoded in place to `out[1..]`.
    let src = 2 + n / 254;
    if n < src + 1 + 8 {
        return Err(EncodeError::BufferTooSmall);
    }
    let region = &mut out[src..n - 1];
    region[..3].copy_from_slice(&MAGIC);
    region[3] = frame_type;
    let body_cap = region.len() - 4;
    let body_len = body(&mut region[4..body_cap])?;
    let crc_at = 4 + body_len;
    let crc = CRC32C.checksum(&region[..crc_at]);
    region[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
    let payload_len = crc_at + 4;
    out[0] = 0;
    let enc = cobs::encode_in_place(out, 1, src, payload_len);
    // enc ≤ payload_len + 1 + payload_len / 254 ≤ payload_len + src - 1, so 1 + enc ≤ n - 1.
    out[1 + enc] = 0;
    Ok(enc + 2)
}

fn finish(w: &ByteWriter<'_>) -> Result<usize, EncodeError> {
    if w.overflowed() {
        Err(EncodeError::BufferTooSmall)
    } else {
        Ok(w.pos())
    }
}

fn short_bytes(w: &mut ByteWriter<'_>, bytes: &[u8]) {
    // Callers pass fixed-capacity fields of at most 255 bytes; a longer one would be cut, never
    // mis-framed.
    let n = u8::try_from(bytes.len()).unwrap_or(u8::MAX);
    w.u8(n);
    w.bytes(&bytes[..usize::from(n)]);
}

/// A count the format limits to a byte (its type's capacity is smaller): as a `u8`.
fn count_u8(n: usize) -> u8 {
    u8::try_from(n).unwrap_or(u8::MAX)
}

/// Encodes the header frame into `out` (size it with `MAX_HEADER_FRAME_LEN`); returns the frame
/// length.
///
/// # Errors
/// `BufferTooSmall`.
pub fn encode_header(h: &Header, out: &mut [u8]) -> Result<usize, EncodeError> {
    write_frame(out, FRAME_HEADER, |body| {
        let mut w = ByteWriter::new(body);
        w.varint(u64::from(h.version));
        short_bytes(&mut w, h.build_id.as_bytes());
        w.varint(h.tsc_hz);
        w.varint(u64::from(h.pcpus));
        w.varint(h.tsc_skew);
        w.varint(h.period_ticks);
        w.u8(h.source);
        // At most MAX_VMS = 64.
        w.u8(count_u8(h.vms.len()));
        for vm in h.vms.iter() {
            w.varint(u64::from(vm.id));
            short_bytes(&mut w, vm.name.as_bytes());
            w.varint(u64::from(vm.vcpus));
            short_bytes(&mut w, vm.image.as_bytes());
            short_bytes(&mut w, vm.image_build_id.as_bytes());
        }
        finish(&w)
    })
}

/// Encodes one block frame of `records` (at most `MAX_BLOCK_RECORDS`) into `out` (size it with
/// [`max_block_frame_len`]); returns the frame length. The records are delta-coded against each
/// other in order, the first against zero: any values round-trip, realistic ones compress.
///
/// # Errors
/// `TooManyRecords`, `BufferTooSmall`.
pub fn encode_block(
    h: &BlockHeader,
    records: &[Record],
    frames: &[u64],
    out: &mut [u8],
) -> Result<usize, EncodeError> {
    if records.len() > MAX_BLOCK_RECORDS {
        return Err(EncodeError::TooManyRecords);
    }
    if crate::types::chain_frames(records) != frames.len() {
        return Err(EncodeError::ChainFrames);
    }
    let ks = codec::choose_params(records, h.period_ticks);
    write_frame(out, FRAME_BLOCK, |body| {
        let head = {
            let mut w = ByteWriter::new(body);
            w.varint(u64::from(h.pcpu));
            w.varint(h.seq);
            w.varint(h.first_sample);
            w.varint(h.first_event);
            w.varint(h.ring_drops);
            w.varint(h.period_ticks);
            w.varint(records.len() as u64);
            w.bytes(&ks.pack());
            finish(&w)?
        };
        let bits = codec::write_records(records, frames, h.period_ticks, ks, &mut body[head..])
            .ok_or(EncodeError::BufferTooSmall)?;
        Ok(head + bits)
    })
}

/// Encodes the end frame (one entry per pCPU) into `out` (size it with [`max_end_frame_len`]);
/// returns the frame length.
///
/// # Errors
/// `TooManyPcpus`, `BufferTooSmall`.
pub fn encode_end(totals: &[PcpuTotals], out: &mut [u8]) -> Result<usize, EncodeError> {
    if totals.len() > MAX_END_PCPUS {
        return Err(EncodeError::TooManyPcpus);
    }
    write_frame(out, FRAME_END, |body| {
        let mut w = ByteWriter::new(body);
        w.varint(totals.len() as u64);
        for t in totals {
            w.varint(u64::from(t.pcpu));
            w.varint(t.samples);
            w.varint(t.events);
            w.varint(t.ring_drops);
            w.varint(t.blocks);
        }
        finish(&w)
    })
}

/// Buffer size that always holds a task frame.
pub const MAX_TASK_FRAME_LEN: usize =
    frame_buffer_len(4 + 3 * 3 + 4 * 10 + 2 * 5 + 1 + COMM_LEN + 4);

/// Encodes a task frame into `out` (size it with [`MAX_TASK_FRAME_LEN`]); returns the frame
/// length.
///
/// # Errors
/// `BufferTooSmall`.
pub fn encode_task(t: &Task, out: &mut [u8]) -> Result<usize, EncodeError> {
    write_frame(out, FRAME_TASK, |body| {
        let mut w = ByteWriter::new(body);
        w.varint(u64::from(t.pcpu));
        w.varint(t.tsc);
        w.varint(u64::from(t.vm));
        w.varint(u64::from(t.vcpu));
        w.varint(t.cr3);
        w.varint(t.task);
        w.varint(u64::from(t.pid));
        w.varint(u64::from(t.tgid));
        short_bytes(&mut w, t.comm.as_str().as_bytes());
        finish(&w)
    })
}

/// Encodes a VM end frame into `out` (size it with [`MAX_VM_END_FRAME_LEN`]); returns the frame
/// length.
///
/// # Errors
/// `BufferTooSmall`.
pub fn encode_vm_end(v: &VmEnd, out: &mut [u8]) -> Result<usize, EncodeError> {
    write_frame(out, FRAME_VM_END, |body| {
        let mut w = ByteWriter::new(body);
        w.varint(u64::from(v.vm));
        w.varint(v.lstar);
        match &v.task_offsets {
            Some(t) => {
                w.u8(1);
                w.varint(t.current_task);
                w.varint(u64::from(t.pid));
                w.varint(u64::from(t.tgid));
                w.varint(u64::from(t.comm));
            }
            None => w.u8(0),
        }
        let e = &v.exits;
        w.varint(e.other);
        // At most EXIT_REASONS = 80 rows, reasons below 80: both fit a byte.
        w.u8(count_u8(e.reasons().count()));
        for (reason, s) in e.reasons() {
            w.u8(count_u8(usize::from(reason)));
            w.varint(s.count);
            w.varint(s.total);
            w.varint(s.min);
            w.varint(s.max);
            let mask = s
                .histogram
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .fold(0u16, |m, (b, _)| m | 1 << b);
            w.bytes(&mask.to_le_bytes());
            for &n in s.histogram.iter().filter(|n| **n > 0) {
                w.varint(u64::from(n));
            }
        }
        // At most EXIT_PORTS = 16.
        w.u8(count_u8(e.ports().len()));
        for &(port, n) in e.ports() {
            w.varint(u64::from(port));
            w.varint(n);
        }
        w.varint(e.ports_other);
        match &v.pause_loop {
            None => w.u8(0),
            Some(p) => {
                w.u8(if p.directed { 2 } else { 1 });
                w.varint(u64::from(p.gap));
                w.varint(u64::from(p.window));
                // At most MAX_SPIN_SITES = 64.
                w.u8(count_u8(p.sites().len()));
                for s in p.sites() {
                    w.varint(u64::from(s.vcpu));
                    w.varint(s.rip);
                    w.varint(s.exits);
                }
                w.varint(p.others);
            }
        }
        match &v.vpmu {
            None => w.u8(0),
            Some(p) => {
                w.u8(if p.domain { 2 } else { 1 });
                // At most MAX_VPMU_VCPUS = 8.
                w.u8(count_u8(p.vcpus().len()));
                for c in p.vcpus() {
                    w.varint(u64::from(c.vcpu));
                    for n in [
                        c.guest_ticks,
                        c.emulated,
                        c.hypervisor_ticks,
                        c.pmis,
                        c.held,
                        c.undelivered,
                        c.exits,
                        c.exit_ticks,
                    ] {
                        w.varint(n);
                    }
                }
            }
        }
        w.u8(match v.page_table_isolation {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        });
        finish(&w)
    })
}

/// Encodes a pCPU cost frame into `out` (size it with [`MAX_PCPU_COST_FRAME_LEN`]); returns the
/// frame length.
///
/// # Errors
/// `BufferTooSmall`.
pub fn encode_pcpu_cost(c: &PcpuCost, out: &mut [u8]) -> Result<usize, EncodeError> {
    write_frame(out, FRAME_PCPU_COST, |body| {
        let mut w = ByteWriter::new(body);
        w.varint(u64::from(c.pcpu));
        for v in [
            c.span_ticks,
            c.samples,
            c.sampling_exits,
            c.sampling_exit_ticks,
            c.timer_interrupts,
            c.timer_ticks,
            c.other_sample_ticks,
            c.export_ticks,
            c.task_reads,
            c.task_read_ticks,
        ] {
            w.varint(v);
        }
        finish(&w)
    })
}

/// Buffer size that always holds a mapping frame.
pub const MAX_MAPPING_FRAME_LEN: usize =
    frame_buffer_len(4 + 3 * 3 + 10 + 1 + 10 + 5 + 3 * 10 + 1 + PATH_LEN + 1 + BUILD_ID_LEN + 4);

/// Encodes a mapping frame into `out` (size it with [`MAX_MAPPING_FRAME_LEN`]); returns the
/// frame length.
///
/// # Errors
/// `BufferTooSmall`.
pub fn encode_mapping(m: &Mapping, out: &mut [u8]) -> Result<usize, EncodeError> {
    write_frame(out, FRAME_MAPPING, |body| {
        let mut w = ByteWriter::new(body);
        w.varint(u64::from(m.pcpu));
        w.varint(m.tsc);
        w.varint(u64::from(m.vm));
        w.varint(u64::from(m.vcpu));
        w.u8(m.kind as u8);
        w.varint(m.cr3);
        w.varint(u64::from(m.tgid));
        w.varint(m.start);
        w.varint(m.end);
        w.varint(m.pgoff);
        short_bytes(&mut w, m.path.as_str().as_bytes());
        short_bytes(&mut w, m.build_id.as_bytes());
        finish(&w)
    })
}

/// Buffer size that always holds an output frame.
pub const MAX_OUTPUT_FRAME_LEN: usize = frame_buffer_len(4 + 3 + 1 + 10 + 3 + MAX_OUTPUT_CHUNK + 4);

/// Encodes an output frame into `out` (size it with [`MAX_OUTPUT_FRAME_LEN`]): the bytes
/// (at most [`MAX_OUTPUT_CHUNK`]) a guest program of VM `o.vm` wrote to `o.stream`, or, for
/// [`OutputStream::Lost`], how many bytes it wrote that the hypervisor could not keep; returns
/// the frame length.
///
/// # Errors
/// `BufferTooSmall`, also for more than `MAX_OUTPUT_CHUNK` bytes.
pub fn encode_output(o: &Output<'_>, out: &mut [u8]) -> Result<usize, EncodeError> {
    if o.bytes.len() > MAX_OUTPUT_CHUNK {
        return Err(EncodeError::BufferTooSmall);
    }
    write_frame(out, FRAME_OUTPUT, |body| {
        let mut w = ByteWriter::new(body);
        w.varint(u64::from(o.vm));
        w.u8(o.stream as u8);
        w.varint(o.lost);
        w.varint(o.bytes.len() as u64);
        w.bytes(o.bytes);
        finish(&w)
    })
}

/// One pCPU's block numbering: sequence numbers and first-sample/first-event indices, advanced by
/// each successfully encoded block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEncoder {
    pcpu: u16,
    period_ticks: u64,
    next_seq: u64,
    samples: u64,
    events: u64,
}

impl BlockEncoder {
    /// Numbering for `pcpu` from block 0; sample TSCs are coded against `period_ticks`.
    #[must_use]
    pub const fn new(pcpu: u16, period_ticks: u64) -> Self {
        Self {
            pcpu,
            period_ticks,
            next_seq: 0,
            samples: 0,
            events: 0,
        }
    }

    /// The header the next block will carry.
    #[must_use]
    pub const fn next_header(&self, ring_drops: u64) -> BlockHeader {
        BlockHeader {
            pcpu: self.pcpu,
            seq: self.next_seq,
            first_sample: self.samples,
            first_event: self.events,
            ring_drops,
            period_ticks: self.period_ticks,
        }
    }

    /// Encodes the next block; on success the numbering advances, on error it does not (retry
    /// with a larger buffer or fewer records).
    ///
    /// # Errors
    /// As [`encode_block`].
    pub fn encode(
        &mut self,
        records: &[Record],
        frames: &[u64],
        ring_drops: u64,
        out: &mut [u8],
    ) -> Result<usize, EncodeError> {
        let n = encode_block(&self.next_header(ring_drops), records, frames, out)?;
        let samples = records
            .iter()
            .filter(|r| matches!(r, Record::Sample(_)))
            .count() as u64;
        self.next_seq += 1;
        self.samples += samples;
        self.events += records.len() as u64 - samples;
        Ok(n)
    }

    /// The totals for the end frame.
    #[must_use]
    pub const fn totals(&self, ring_drops: u64) -> PcpuTotals {
        PcpuTotals {
            pcpu: self.pcpu,
            samples: self.samples,
            events: self.events,
            ring_drops,
            blocks: self.next_seq,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn frame_buffer_len_is_enough_for_in_place_cobs() {
        for l in 0..20_000usize {
            let n = frame_buffer_len(l);
            let src = 2 + n / 254;
            assert!(n - 1 - src >= l, "payload {l}");
            assert!(n <= cobs::max_encoded_len(l) + 4, "wasteful at {l}");
        }
    }

    #[test]
    fn too_small_buffers_are_refused_not_overrun() {
        let h = Header::default();
        let need = encode_header(&h, &mut [0u8; MAX_HEADER_FRAME_LEN]).unwrap();
        for n in 0..need {
            let mut buf = vec![0u8; n];
            assert_eq!(
                encode_header(&h, &mut buf),
                Err(EncodeError::BufferTooSmall)
            );
        }
        let rec = [Record::Sample(crate::Sample {
            tsc: u64::MAX,
            guest_rip: u64::MAX,
            ..Default::default()
        })];
        let need = {
            let mut big = vec![0u8; max_block_frame_len(1, 0)];
            encode_block(&BlockHeader::default(), &rec, &[], &mut big).unwrap()
        };
        for n in 0..need {
            let mut buf = vec![0u8; n];
            assert!(encode_block(&BlockHeader::default(), &rec, &[], &mut buf).is_err());
        }
    }
}
