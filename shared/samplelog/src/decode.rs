//! The decoder (feature `std`): a streaming frame splitter/classifier ([`StreamDecoder`]), an
//! accumulator of its items ([`Collector`] → [`Decoded`]), and [`decode`] for a whole capture.
//! Never panics, whatever the input; allocation is bounded by the input size.

use std::collections::BTreeMap;
use std::mem;

use rustc_hash::FxHashSet as HashSet;

use crate::bits::{ByteReader, Malformed};
use crate::cobs;
use crate::codec;
use crate::encode::{
    FRAME_BLOCK, FRAME_END, FRAME_HEADER, FRAME_MAPPING, FRAME_OUTPUT, FRAME_PCPU_COST, FRAME_TASK,
    FRAME_VM_END, MAGIC, MAX_BLOCK_RECORDS, MAX_END_PCPUS, MAX_FRAME_BYTES, MAX_FRAME_TYPE,
    MAX_OUTPUT_CHUNK,
};
use crate::stats::{
    EXIT_PORTS, EXIT_REASONS, ExitStats, HISTOGRAM_BUCKETS, MAX_SPIN_SITES, MAX_VPMU_VCPUS,
    PauseLoop, PcpuCost, ReasonStats, SpinSite, TaskOffsets, VmEnd, VpmuCounts, VpmuEnd,
};
use crate::types::{
    BUILD_ID_LEN, BlockHeader, BuildId, COMM_LEN, FixedStr, Header, MAX_VMS, Mapping, MappingKind,
    Output, OutputStream, PATH_LEN, PcpuTotals, Record, Task, VmInfo,
};

/// Spans (bytes between two `0x00`) longer than this are classified in pieces, bounding memory.
const MAX_SPAN: usize = 4 << 20;
/// Failed frame candidates tried per span (with `MAX_FRAME_BYTES`, bounds work on hostile input).
const MAX_ATTEMPTS: usize = 16;

/// What was wrong with a stretch of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DamageKind {
    /// Looked like a frame, decoded completely, but its CRC did not match.
    Crc,
    /// Looked like a frame but its COBS structure was broken (a byte lost, a `0x00` injected).
    Cobs,
    /// CRC matched but the body was malformed (an encoder bug, or a 2^-32 CRC collision).
    Malformed,
    /// Looked like a frame and the stream ended inside it.
    Truncated,
    /// Neither a frame nor UTF-8 text (for example the tail of a frame cut by an injected `0x00`).
    Unrecognized,
}

/// A damaged stretch of the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Damage {
    /// Stream offset of its first byte.
    pub offset: u64,
    /// Its length in bytes (delimiters excluded).
    pub len: u64,
    /// What was wrong.
    pub kind: DamageKind,
}

/// Console text found between frames.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TextSpan {
    /// Stream offset of its first byte.
    pub offset: u64,
    /// The text, as received (lines keep their `\n`).
    pub text: String,
}

/// One thing found in the stream, in stream order. Borrowed data lives until the next call
/// into the decoder.
#[derive(Clone, Copy, Debug)]
pub enum Item<'a> {
    /// A header frame.
    Header {
        /// Stream offset of the frame (its COBS code byte).
        offset: u64,
        /// The header.
        header: &'a Header,
    },
    /// A block frame.
    Block {
        /// Stream offset of the frame.
        offset: u64,
        /// Its header.
        header: BlockHeader,
        /// Its records.
        records: &'a [Record],
        /// Its samples' call-chain frames (see [`crate::with_chains`]).
        frames: &'a [u64],
    },
    /// An end frame.
    End {
        /// Stream offset of the frame.
        offset: u64,
        /// Per-pCPU totals.
        totals: &'a [PcpuTotals],
    },
    /// A task frame: which guest task a vCPU runs from a sample on.
    Task {
        /// Stream offset of the frame.
        offset: u64,
        /// The task.
        task: Task,
    },
    /// A VM end frame: a VM's exit statistics, LSTAR and task offsets.
    VmEnd {
        /// Stream offset of the frame.
        offset: u64,
        /// What it carried.
        vm_end: &'a VmEnd,
    },
    /// A pCPU cost frame: the profiler's whole cost on one pCPU.
    PcpuCost {
        /// Stream offset of the frame.
        offset: u64,
        /// What it carried.
        cost: PcpuCost,
    },
    /// A mapping frame: executable code a guest maps (a process's file or a module).
    Mapping {
        /// Stream offset of the frame.
        offset: u64,
        /// The mapping.
        mapping: &'a Mapping,
    },
    /// An output frame: bytes a guest program wrote (or how many were lost).
    Output {
        /// Stream offset of the frame.
        offset: u64,
        /// What it carried.
        output: Output<'a>,
    },
    /// A valid frame of a type this decoder does not know (9..=15).
    Unknown {
        /// Stream offset of the frame.
        offset: u64,
        /// Its type byte.
        frame_type: u8,
    },
    /// Console text.
    Text {
        /// Stream offset of the text.
        offset: u64,
        /// The text.
        text: &'a str,
    },
    /// Damage.
    Damage(Damage),
}

/// Which body a frame carried.
#[derive(Clone, Copy)]
enum Parsed {
    Header,
    Block(BlockHeader),
    End,
    Task(Task),
    VmEnd,
    PcpuCost(PcpuCost),
    Mapping,
    Output,
    Unknown(u8),
}

/// Scratch space the body parsers fill.
struct Scratch {
    /// Whether blocks' records are decoded ([`decode_metadata_parallel`] reads none).
    records_wanted: bool,
    payload: Vec<u8>,
    records: Vec<Record>,
    frames: Vec<u64>,
    header: Box<Header>,
    totals: Vec<PcpuTotals>,
    vm_end: Box<VmEnd>,
    mapping: Box<Mapping>,
    /// The last output frame: VM, stream, lost count, and its bytes in `output_bytes`.
    output: (u16, OutputStream, u64),
    output_bytes: Vec<u8>,
}

/// Incremental decoder: feed it the capture in chunks of any size.
pub struct StreamDecoder {
    /// Bytes of the current span not yet ended by a `0x00`.
    pending: Vec<u8>,
    pending_start: u64,
    pos: u64,
    scratch: Scratch,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamDecoder {
    /// A decoder at stream offset 0.
    #[must_use]
    pub fn new() -> Self {
        Self {
            pending: Vec::new(),
            pending_start: 0,
            pos: 0,
            scratch: Scratch {
                records_wanted: true,
                payload: Vec::new(),
                records: Vec::new(),
                frames: Vec::new(),
                header: Box::default(),
                totals: Vec::new(),
                vm_end: Box::default(),
                mapping: Box::default(),
                output: (0, OutputStream::Stdout, 0),
                output_bytes: Vec::new(),
            },
        }
    }

    /// A decoder for a part of a stream that starts at byte `offset` of the whole (item offsets
    /// are then stream offsets). The part should start at a `0x00` delimiter or at the stream's
    /// start.
    #[must_use]
    pub fn starting_at(offset: u64) -> Self {
        let mut d = Self::new();
        d.pos = offset;
        d
    }

    /// Bytes fed so far (plus the starting offset).
    #[must_use]
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Feeds the next bytes of the stream; `sink` receives every item completed by them.
    pub fn feed(&mut self, bytes: &[u8], sink: &mut dyn FnMut(Item<'_>)) {
        let mut rest = bytes;
        while let Some(z) = memchr::memchr(0, rest) {
            let span = &rest[..z];
            if self.pending.is_empty() {
                let start = self.pos;
                self.scratch.span(span, start, false, sink);
            } else {
                self.pending.extend_from_slice(span);
                let pending = mem::take(&mut self.pending);
                self.scratch.span(&pending, self.pending_start, false, sink);
                self.pending = pending;
                self.pending.clear();
            }
            self.pos += z as u64 + 1;
            rest = &rest[z + 1..];
        }
        if !rest.is_empty() {
            if self.pending.is_empty() {
                self.pending_start = self.pos;
            }
            self.pending.extend_from_slice(rest);
            self.pos += rest.len() as u64;
            if self.pending.len() > MAX_SPAN {
                let pending = mem::take(&mut self.pending);
                self.scratch.span(&pending, self.pending_start, false, sink);
                self.pending = pending;
                self.pending.clear();
            }
        }
    }

    /// Ends the stream: classifies what follows the last `0x00` (a frame missing only its final
    /// delimiter is still recovered; an incomplete one is reported as truncated).
    pub fn finish(&mut self, sink: &mut dyn FnMut(Item<'_>)) {
        if !self.pending.is_empty() {
            let pending = mem::take(&mut self.pending);
            self.scratch.span(&pending, self.pending_start, true, sink);
            self.pending = pending;
            self.pending.clear();
        }
    }
}

/// Whether a frame may start at `span[i]`: first COBS code ≥ 5 (magic and type are in the first
/// group, copied verbatim), then `"HVP"`, then a frame type in `1..=MAX_FRAME_TYPE`.
#[inline]
fn is_candidate(span: &[u8], i: usize) -> bool {
    matches!(span.get(i..i + 5), Some(&[code, b'H', b'V', b'P', t])
        if code >= 5 && (1..=MAX_FRAME_TYPE).contains(&t))
}

fn find_candidate(span: &[u8], from: usize) -> Option<usize> {
    (from..span.len().saturating_sub(4)).find(|&i| is_candidate(span, i))
}

fn text_or_garbage(bytes: &[u8], offset: u64, sink: &mut dyn FnMut(Item<'_>)) {
    if bytes.is_empty() {
        return;
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => sink(Item::Text { offset, text }),
        Err(_) => sink(Item::Damage(Damage {
            offset,
            len: bytes.len() as u64,
            kind: DamageKind::Unrecognized,
        })),
    }
}

/// Reports `seg` (which holds no valid frame): text before the first failed frame candidate,
/// damage from it on — unless that part is valid UTF-8 (console text that happens to contain the
/// frame pattern; a damaged binary frame practically never is).
fn filler(
    seg: &[u8],
    offset: u64,
    failed: Option<(usize, DamageKind)>,
    sink: &mut dyn FnMut(Item<'_>),
) {
    match failed {
        Some((at, kind)) if at < seg.len() && std::str::from_utf8(&seg[at..]).is_err() => {
            text_or_garbage(&seg[..at], offset, sink);
            sink(Item::Damage(Damage {
                offset: offset + at as u64,
                len: (seg.len() - at) as u64,
                kind,
            }));
        }
        _ => text_or_garbage(seg, offset, sink),
    }
}

/// Whether `crc` is the CRC-32C of `data` (computed by the crc32c crate, with the CPU's CRC32
/// instruction where it has one; the encoder's table-driven [`crate::crc32c`] is the same
/// checksum).
fn crc_ok(data: &[u8], crc: &[u8]) -> bool {
    match <[u8; 4]>::try_from(crc) {
        Ok(c) => crc32c::crc32c(data) == u32::from_le_bytes(c),
        Err(_) => false,
    }
}

impl Scratch {
    /// Classifies one span (the bytes between two `0x00`).
    fn span(&mut self, span: &[u8], offset: u64, at_eof: bool, sink: &mut dyn FnMut(Item<'_>)) {
        if span.is_empty() {
            return;
        }
        // Blocks unread: a span that begins as a block frame and holds no other frame's start
        // (no "HVP" past its own) is one block, valid or damaged, and is skipped without being
        // decoded (any other span is read as always: a block glued to the frame that follows
        // it, its delimiter lost, is taken apart).
        if !self.records_wanted
            && is_candidate(span, 0)
            && span[4] == FRAME_BLOCK
            && memchr::memmem::find(&span[5..], &MAGIC).is_none()
        {
            return;
        }
        let mut seg_start = 0;
        let mut search = 0;
        // First failed candidate since the last success, relative to `seg_start`.
        let mut failed: Option<(usize, DamageKind)> = None;
        let mut attempts = 0;
        while attempts < MAX_ATTEMPTS {
            let Some(c) = find_candidate(span, search) else {
                break;
            };
            let raw = &span[c..span.len().min(c + MAX_FRAME_BYTES)];
            match self.frame(raw, at_eof) {
                Ok((parsed, used)) => {
                    filler(
                        &span[seg_start..c],
                        offset + seg_start as u64,
                        failed.take(),
                        sink,
                    );
                    self.emit(parsed, offset + c as u64, sink);
                    seg_start = c + used;
                    search = seg_start;
                }
                Err(kind) => {
                    if failed.is_none() {
                        failed = Some((c - seg_start, kind));
                    }
                    search = c + 1;
                    attempts += 1;
                }
            }
        }
        filler(&span[seg_start..], offset + seg_start as u64, failed, sink);
    }

    fn emit(&self, parsed: Parsed, offset: u64, sink: &mut dyn FnMut(Item<'_>)) {
        sink(match parsed {
            Parsed::Header => Item::Header {
                offset,
                header: &self.header,
            },
            Parsed::Block(header) => Item::Block {
                offset,
                header,
                records: &self.records,
                frames: &self.frames,
            },
            Parsed::End => Item::End {
                offset,
                totals: &self.totals,
            },
            Parsed::Task(task) => Item::Task { offset, task },
            Parsed::VmEnd => Item::VmEnd {
                offset,
                vm_end: &self.vm_end,
            },
            Parsed::PcpuCost(cost) => Item::PcpuCost { offset, cost },
            Parsed::Mapping => Item::Mapping {
                offset,
                mapping: &self.mapping,
            },
            Parsed::Output => Item::Output {
                offset,
                output: Output {
                    vm: self.output.0,
                    stream: self.output.1,
                    lost: self.output.2,
                    bytes: &self.output_bytes,
                },
            },
            Parsed::Unknown(frame_type) => Item::Unknown { offset, frame_type },
        });
    }

    /// Tries to decode a frame at the start of `raw` (a candidate position). On success returns
    /// what it held and how many bytes of `raw` it used.
    fn frame(&mut self, raw: &[u8], at_eof: bool) -> Result<(Parsed, usize), DamageKind> {
        let mut payload = mem::take(&mut self.payload);
        let (len, complete) = cobs::decode(raw, &mut payload);
        let result = self.frame_payload(&payload[..len], raw.len(), complete, at_eof);
        self.payload = payload;
        result
    }

    fn frame_payload(
        &mut self,
        p: &[u8],
        raw_len: usize,
        complete: bool,
        at_eof: bool,
    ) -> Result<(Parsed, usize), DamageKind> {
        let failure = if at_eof {
            DamageKind::Truncated
        } else if complete {
            DamageKind::Crc
        } else {
            DamageKind::Cobs
        };
        if p.len() < 8 || p[..3] != MAGIC {
            return Err(failure);
        }
        let frame_type = p[3];
        // Fast path: the span is exactly one frame.
        if complete {
            let (covered, crc) = p.split_at(p.len() - 4);
            if crc_ok(covered, crc) {
                let body = &covered[4..];
                if frame_type == FRAME_BLOCK && !self.records_wanted {
                    // A whole frame whose CRC holds: a block, whatever its records say.
                    self.records.clear();
                    self.frames.clear();
                    return match parse_block_header(&mut ByteReader::new(body)) {
                        Ok(h) => Ok((Parsed::Block(h), raw_len)),
                        Err(Malformed) => Err(DamageKind::Malformed),
                    };
                }
                return match self.body(frame_type, body) {
                    Ok((parsed, n)) if n == body.len() => Ok((parsed, raw_len)),
                    Ok(_) | Err(Malformed) => Err(DamageKind::Malformed),
                };
            }
        }
        // Slow path: the frame's structure may end before the span does (its trailing delimiter
        // was lost); the CRC must then sit right after the structure.
        if let Ok((parsed, n)) = self.body(frame_type, &p[4..]) {
            let end = 4 + n;
            if let (Some(covered), Some(crc)) = (p.get(..end), p.get(end..end + 4))
                && !matches!(parsed, Parsed::Unknown(_))
                && crc_ok(covered, crc)
            {
                let used = cobs::encoded_len(&p[..end + 4]);
                if used <= raw_len {
                    return Ok((parsed, used));
                }
            }
        }
        Err(failure)
    }

    /// Parses a body; returns what it was and the bytes it used (unknown types use everything).
    fn body(&mut self, frame_type: u8, body: &[u8]) -> Result<(Parsed, usize), Malformed> {
        match frame_type {
            FRAME_HEADER => parse_header(body, &mut self.header).map(|n| (Parsed::Header, n)),
            FRAME_BLOCK => parse_block(body, &mut self.records, &mut self.frames)
                .map(|(h, n)| (Parsed::Block(h), n)),
            FRAME_END => parse_end(body, &mut self.totals).map(|n| (Parsed::End, n)),
            FRAME_TASK => parse_task(body).map(|(t, n)| (Parsed::Task(t), n)),
            FRAME_VM_END => parse_vm_end(body, &mut self.vm_end).map(|n| (Parsed::VmEnd, n)),
            FRAME_PCPU_COST => parse_pcpu_cost(body).map(|(c, n)| (Parsed::PcpuCost(c), n)),
            FRAME_MAPPING => parse_mapping(body, &mut self.mapping).map(|n| (Parsed::Mapping, n)),
            FRAME_OUTPUT => parse_output(body, &mut self.output, &mut self.output_bytes)
                .map(|n| (Parsed::Output, n)),
            t => Ok((Parsed::Unknown(t), body.len())),
        }
    }
}

fn short_bytes<'a>(r: &mut ByteReader<'a>, max: usize) -> Result<&'a [u8], Malformed> {
    let n = usize::from(r.u8()?);
    if n > max {
        return Err(Malformed);
    }
    r.bytes(n)
}

fn parse_header(body: &[u8], h: &mut Header) -> Result<usize, Malformed> {
    let mut r = ByteReader::new(body);
    h.version = r.varint_u16()?;
    h.build_id = BuildId::new(short_bytes(&mut r, BUILD_ID_LEN)?).map_err(|_| Malformed)?;
    h.tsc_hz = r.varint()?;
    h.pcpus = r.varint_u16()?;
    h.tsc_skew = r.varint()?;
    h.period_ticks = r.varint()?;
    h.source = r.u8()?;
    let n = usize::from(r.u8()?);
    if n > MAX_VMS {
        return Err(Malformed);
    }
    h.vms.clear();
    for _ in 0..n {
        let id = r.varint_u16()?;
        let name = FixedStr::from_utf8(short_bytes(&mut r, 32)?).ok_or(Malformed)?;
        let vcpus = r.varint_u16()?;
        let image = FixedStr::from_utf8(short_bytes(&mut r, 64)?).ok_or(Malformed)?;
        let image_build_id =
            BuildId::new(short_bytes(&mut r, BUILD_ID_LEN)?).map_err(|_| Malformed)?;
        h.vms
            .push(VmInfo {
                id,
                name,
                vcpus,
                image,
                image_build_id,
            })
            .map_err(|_| Malformed)?;
    }
    Ok(r.pos())
}

fn parse_block(
    body: &[u8],
    records: &mut Vec<Record>,
    frames: &mut Vec<u64>,
) -> Result<(BlockHeader, usize), Malformed> {
    let mut r = ByteReader::new(body);
    let h = parse_block_header(&mut r)?;
    let count = usize::try_from(r.varint()?).map_err(|_| Malformed)?;
    if count > MAX_BLOCK_RECORDS {
        return Err(Malformed);
    }
    let mut ks = [0u8; codec::PARAMS_LEN];
    ks.copy_from_slice(r.bytes(codec::PARAMS_LEN)?);
    let ks = codec::Params::unpack(ks)?;
    records.clear();
    frames.clear();
    let bits = codec::read_records(r.rest(), count, h.period_ticks, ks, records, frames)?;
    Ok((h, r.pos() + bits))
}

/// A block's header: its numbering, before its record count.
fn parse_block_header(r: &mut ByteReader<'_>) -> Result<BlockHeader, Malformed> {
    Ok(BlockHeader {
        pcpu: r.varint_u16()?,
        seq: r.varint()?,
        first_sample: r.varint()?,
        first_event: r.varint()?,
        ring_drops: r.varint()?,
        period_ticks: r.varint()?,
    })
}

fn parse_task(body: &[u8]) -> Result<(Task, usize), Malformed> {
    let mut r = ByteReader::new(body);
    let u32v = |v: u64| u32::try_from(v).map_err(|_| Malformed);
    let t = Task {
        pcpu: r.varint_u16()?,
        tsc: r.varint()?,
        vm: r.varint_u16()?,
        vcpu: r.varint_u16()?,
        cr3: r.varint()?,
        task: r.varint()?,
        pid: u32v(r.varint()?)?,
        tgid: u32v(r.varint()?)?,
        comm: FixedStr::from_utf8(short_bytes(&mut r, COMM_LEN)?).ok_or(Malformed)?,
    };
    Ok((t, r.pos()))
}

fn parse_vm_end(body: &[u8], v: &mut VmEnd) -> Result<usize, Malformed> {
    let mut r = ByteReader::new(body);
    let u32v = |v: u64| u32::try_from(v).map_err(|_| Malformed);
    v.vm = r.varint_u16()?;
    v.lstar = r.varint()?;
    v.task_offsets = match r.u8()? {
        0 => None,
        1 => Some(TaskOffsets {
            current_task: r.varint()?,
            pid: u32v(r.varint()?)?,
            tgid: u32v(r.varint()?)?,
            comm: u32v(r.varint()?)?,
        }),
        _ => return Err(Malformed),
    };
    let mut e = ExitStats::new();
    e.other = r.varint()?;
    let rows = usize::from(r.u8()?);
    if rows > EXIT_REASONS {
        return Err(Malformed);
    }
    let mut next_reason = 0u16;
    for _ in 0..rows {
        // Rows come in ascending reason order, each once, each with at least one exit.
        let reason = u16::from(r.u8()?);
        if reason < next_reason {
            return Err(Malformed);
        }
        next_reason = reason + 1;
        let mut s = ReasonStats {
            count: r.varint()?,
            total: r.varint()?,
            min: r.varint()?,
            max: r.varint()?,
            histogram: [0; HISTOGRAM_BUCKETS],
        };
        if s.count == 0 || s.min > s.max {
            return Err(Malformed);
        }
        let mask = u16::from_le_bytes([r.u8()?, r.u8()?]);
        for (b, h) in s.histogram.iter_mut().enumerate() {
            if mask & (1 << b) != 0 {
                *h = u32v(r.varint()?)?;
                if *h == 0 {
                    return Err(Malformed);
                }
            }
        }
        if !e.set_reason(reason, s) {
            return Err(Malformed);
        }
    }
    let ports = usize::from(r.u8()?);
    if ports > EXIT_PORTS {
        return Err(Malformed);
    }
    for _ in 0..ports {
        let port = r.varint_u16()?;
        let n = r.varint()?;
        if n == 0 || e.port(port) != 0 {
            return Err(Malformed);
        }
        e.add_port_count(port, n);
    }
    e.ports_other = r.varint()?;
    v.exits = e;
    // A frame from before pause-loop exiting ends here.
    v.pause_loop = if r.pos() == body.len() {
        None
    } else {
        match r.u8()? {
            0 => None,
            mode @ (1 | 2) => {
                let mut p = PauseLoop::new(mode == 2, u32v(r.varint()?)?, u32v(r.varint()?)?);
                let sites = usize::from(r.u8()?);
                if sites > MAX_SPIN_SITES {
                    return Err(Malformed);
                }
                for _ in 0..sites {
                    let site = SpinSite {
                        vcpu: r.varint_u16()?,
                        rip: r.varint()?,
                        exits: r.varint()?,
                    };
                    if site.exits == 0 {
                        return Err(Malformed);
                    }
                    p.add(site);
                }
                p.others = r.varint()?;
                Some(p)
            }
            _ => return Err(Malformed),
        }
    };
    // A frame from before the virtual PMU ends here.
    v.vpmu = if r.pos() == body.len() {
        None
    } else {
        match r.u8()? {
            0 => None,
            mode @ (1 | 2) => {
                let mut p = VpmuEnd::new(mode == 2);
                let n = usize::from(r.u8()?);
                if n == 0 || n > MAX_VPMU_VCPUS {
                    return Err(Malformed);
                }
                for _ in 0..n {
                    // The fields in wire order (a struct literal evaluates in the order written).
                    p.add(VpmuCounts {
                        vcpu: r.varint_u16()?,
                        guest_ticks: r.varint()?,
                        emulated: r.varint()?,
                        hypervisor_ticks: r.varint()?,
                        pmis: r.varint()?,
                        held: r.varint()?,
                        undelivered: r.varint()?,
                        exits: r.varint()?,
                        exit_ticks: r.varint()?,
                    });
                }
                Some(p)
            }
            _ => return Err(Malformed),
        }
    };
    // A frame from before the page-table isolation byte ends here.
    v.page_table_isolation = if r.pos() == body.len() {
        None
    } else {
        match r.u8()? {
            0 => None,
            1 => Some(false),
            2 => Some(true),
            _ => return Err(Malformed),
        }
    };
    Ok(r.pos())
}

fn parse_mapping(body: &[u8], m: &mut Mapping) -> Result<usize, Malformed> {
    let mut r = ByteReader::new(body);
    let u32v = |v: u64| u32::try_from(v).map_err(|_| Malformed);
    m.pcpu = r.varint_u16()?;
    m.tsc = r.varint()?;
    m.vm = r.varint_u16()?;
    m.vcpu = r.varint_u16()?;
    m.kind = match r.u8()? {
        0 => MappingKind::Process,
        1 => MappingKind::Module,
        _ => return Err(Malformed),
    };
    m.cr3 = r.varint()?;
    m.tgid = u32v(r.varint()?)?;
    m.start = r.varint()?;
    m.end = r.varint()?;
    m.pgoff = r.varint()?;
    if m.start >= m.end {
        return Err(Malformed);
    }
    m.path = FixedStr::from_utf8(short_bytes(&mut r, PATH_LEN)?).ok_or(Malformed)?;
    m.build_id = BuildId::new(short_bytes(&mut r, BUILD_ID_LEN)?).map_err(|_| Malformed)?;
    Ok(r.pos())
}

fn parse_output(
    body: &[u8],
    o: &mut (u16, OutputStream, u64),
    bytes: &mut Vec<u8>,
) -> Result<usize, Malformed> {
    let mut r = ByteReader::new(body);
    o.0 = r.varint_u16()?;
    o.1 = OutputStream::from_u8(r.u8()?).ok_or(Malformed)?;
    o.2 = r.varint()?;
    let n = usize::try_from(r.varint()?).map_err(|_| Malformed)?;
    // Bytes with a lost count, or a count with bytes, is no frame the encoder writes.
    let lost = o.1 == OutputStream::Lost;
    if n > MAX_OUTPUT_CHUNK || (lost && n != 0) || (!lost && (n == 0 || o.2 != 0)) {
        return Err(Malformed);
    }
    bytes.clear();
    bytes.extend_from_slice(r.bytes(n)?);
    Ok(r.pos())
}

fn parse_pcpu_cost(body: &[u8]) -> Result<(PcpuCost, usize), Malformed> {
    let mut r = ByteReader::new(body);
    let c = PcpuCost {
        pcpu: r.varint_u16()?,
        span_ticks: r.varint()?,
        samples: r.varint()?,
        sampling_exits: r.varint()?,
        sampling_exit_ticks: r.varint()?,
        timer_interrupts: r.varint()?,
        timer_ticks: r.varint()?,
        other_sample_ticks: r.varint()?,
        export_ticks: r.varint()?,
        task_reads: r.varint()?,
        task_read_ticks: r.varint()?,
    };
    Ok((c, r.pos()))
}

fn parse_end(body: &[u8], totals: &mut Vec<PcpuTotals>) -> Result<usize, Malformed> {
    let mut r = ByteReader::new(body);
    let n = usize::try_from(r.varint()?).map_err(|_| Malformed)?;
    if n > MAX_END_PCPUS {
        return Err(Malformed);
    }
    totals.clear();
    totals.reserve(n.min(body.len() / 5));
    for _ in 0..n {
        totals.push(PcpuTotals {
            pcpu: r.varint_u16()?,
            samples: r.varint()?,
            events: r.varint()?,
            ring_drops: r.varint()?,
            blocks: r.varint()?,
        });
    }
    Ok(r.pos())
}

/// Records missing from a pCPU's stream, and over which host time: blocks lost on the way, samples
/// the hypervisor dropped (its ring was full), or the end of a log without end frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Gap {
    /// The pCPU.
    pub pcpu: u16,
    /// Index in `PcpuLog::records` where the missing records belong.
    pub at_record: usize,
    /// Blocks lost here.
    pub blocks: u64,
    /// Samples those blocks held.
    pub samples: u64,
    /// Events those blocks held.
    pub events: u64,
    /// Samples the hypervisor dropped here, never recorded: how much the blocks' drop count rose
    /// from the block before the gap to the one after (or to the end frame's). The hypervisor
    /// never lets a block span a drop, so they were lost between those two blocks' records.
    pub dropped: u64,
    /// TSC of the last record received before the gap (`None` at the start of the stream): the
    /// loss starts after it.
    pub after_tsc: Option<u64>,
    /// TSC of the first record received after the gap (`None` at the end of the stream): the
    /// loss ends before it.
    pub before_tsc: Option<u64>,
    /// The log ends here without an end frame: what the pCPU recorded after `after_tsc` is
    /// unknown (`blocks`, `samples` and `events` count only what is known lost).
    pub truncated: bool,
}

/// One pCPU's decoded stream and its losses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PcpuLog {
    /// The pCPU.
    pub pcpu: u16,
    /// Records of all received blocks, in block order.
    pub records: Vec<Record>,
    /// The call-chain frames of `records`' samples, in the same order (see
    /// [`crate::with_chains`]).
    pub frames: Vec<u64>,
    /// Distinct blocks received.
    pub blocks_received: u64,
    /// Blocks lost: sequence gaps, including before the first block received and — when the end
    /// frame was seen — after the last.
    pub blocks_lost: u64,
    /// Samples in the lost blocks (exact; saturates at `u64::MAX`, as do the other loss counts,
    /// when the input claims more).
    pub samples_lost: u64,
    /// Events in the lost blocks (exact).
    pub events_lost: u64,
    /// Blocks received more than once (later copies are ignored).
    pub duplicate_blocks: u64,
    /// Blocks whose numbering contradicts their neighbours or the end frame (should be 0).
    pub inconsistent_blocks: u64,
    /// The pCPU's ring drops: samples never recorded because its ring was full (from the end
    /// frame, else from the last block received).
    pub ring_drops: u64,
    /// This pCPU's entry of the end frame.
    pub totals: Option<PcpuTotals>,
    /// Where records are missing (lost blocks, samples dropped by the hypervisor, a truncated
    /// end), in stream order.
    pub gaps: Vec<Gap>,
}

impl PcpuLog {
    /// Counts a gap's losses (saturating: the counts come from the input, which may claim
    /// anything up to 2^64 per gap) and records it.
    fn add_gap(&mut self, gap: Gap) {
        self.blocks_lost = self.blocks_lost.saturating_add(gap.blocks);
        self.samples_lost = self.samples_lost.saturating_add(gap.samples);
        self.events_lost = self.events_lost.saturating_add(gap.events);
        self.gaps.push(gap);
    }

    /// Samples lost in its gaps: in lost blocks and dropped by the hypervisor (saturating).
    #[must_use]
    pub fn samples_missing(&self) -> u64 {
        self.gaps.iter().fold(0, |n, g| {
            n.saturating_add(g.samples).saturating_add(g.dropped)
        })
    }

    /// The samples received.
    pub fn samples(&self) -> impl Iterator<Item = &crate::Sample> {
        self.records.iter().filter_map(Record::as_sample)
    }

    /// The samples received, with their call chains.
    pub fn samples_with_chains(&self) -> impl Iterator<Item = (&crate::Sample, crate::Chains<'_>)> {
        crate::with_chains(&self.records, &self.frames)
            .filter_map(|(r, c)| Some((r.as_sample()?, c)))
    }

    /// Whether every block this pCPU sent was received (needs the end frame).
    #[must_use]
    pub fn is_complete(&self) -> bool {
        self.totals.is_some() && self.blocks_lost == 0 && self.inconsistent_blocks == 0
    }
}

/// A decoded capture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    /// The first header frame received.
    pub header: Option<Header>,
    /// Header frames received.
    pub header_frames: u64,
    /// Header frames that differ from the first one.
    pub header_conflicts: u64,
    /// Per-pCPU streams (pCPUs seen in blocks or in the end frame).
    pub pcpus: BTreeMap<u16, PcpuLog>,
    /// The last end frame received (`None`: the capture is truncated, or its end frame damaged).
    pub end: Option<Vec<PcpuTotals>>,
    /// Valid frames of every type.
    pub frames: u64,
    /// Valid frames of unknown types.
    pub unknown_frames: u64,
    /// Task frames, in stream order.
    pub tasks: Vec<Task>,
    /// VM end frames, in stream order (a VM's last one is its final state).
    pub vm_ends: Vec<VmEnd>,
    /// pCPU cost frames, in stream order.
    pub costs: Vec<PcpuCost>,
    /// Mapping frames, in stream order.
    pub mappings: Vec<Mapping>,
    /// Guest programs' output (output frames), per VM and stream, in the order written.
    pub output: BTreeMap<(u16, OutputStream), Vec<u8>>,
    /// Per VM: bytes of guest output the hypervisor could not keep.
    pub output_lost: BTreeMap<u16, u64>,
    /// Damaged frames and unrecognised bytes, in stream order.
    pub damaged: Vec<Damage>,
    /// Console text, in stream order.
    pub text: Vec<TextSpan>,
    /// Bytes decoded.
    pub bytes: u64,
}

impl Decoded {
    /// Whether the end frame was received (otherwise losses after the last block of each pCPU
    /// are unknown).
    #[must_use]
    pub fn end_seen(&self) -> bool {
        self.end.is_some()
    }

    /// End frame seen, no block lost on any pCPU.
    #[must_use]
    pub fn is_complete(&self) -> bool {
        self.end_seen() && self.pcpus.values().all(PcpuLog::is_complete)
    }

    /// Samples received, all pCPUs.
    #[must_use]
    pub fn samples(&self) -> u64 {
        self.pcpus
            .values()
            .map(|p| p.samples().count() as u64)
            .sum()
    }

    /// Blocks lost, all pCPUs.
    #[must_use]
    pub fn blocks_lost(&self) -> u64 {
        self.pcpus
            .values()
            .fold(0, |n, p| n.saturating_add(p.blocks_lost))
    }

    /// Events lost in lost blocks, all pCPUs.
    #[must_use]
    pub fn events_lost(&self) -> u64 {
        self.pcpus
            .values()
            .fold(0, |n, p| n.saturating_add(p.events_lost))
    }

    /// Samples lost in lost blocks, all pCPUs.
    #[must_use]
    pub fn samples_lost(&self) -> u64 {
        self.pcpus
            .values()
            .fold(0, |n, p| n.saturating_add(p.samples_lost))
    }

    /// Ring drops, all pCPUs.
    #[must_use]
    pub fn ring_drops(&self) -> u64 {
        self.pcpus
            .values()
            .fold(0, |n, p| n.saturating_add(p.ring_drops))
    }

    /// Every pCPU's gaps, by pCPU then in stream order: where records are missing and over which
    /// host time.
    pub fn gaps(&self) -> impl Iterator<Item = &Gap> {
        self.pcpus.values().flat_map(|p| p.gaps.iter())
    }

    /// All text spans concatenated.
    #[must_use]
    pub fn text_joined(&self) -> String {
        self.text.iter().map(|t| t.text.as_str()).collect()
    }
}

#[derive(Clone, Copy)]
struct BlockMeta {
    h: BlockHeader,
    start: usize,
    len: usize,
    /// Where its chain frames start in `PcpuAcc::frames`, and how many.
    frames_start: usize,
    frames_len: usize,
    samples: u64,
    /// TSCs of its first and last records.
    tsc: Option<(u64, u64)>,
}

#[derive(Default)]
struct PcpuAcc {
    blocks: Vec<BlockMeta>,
    records: Vec<Record>,
    frames: Vec<u64>,
    seqs: HashSet<u64>,
    sorted: bool,
    duplicates: u64,
}

/// Builds a [`Decoded`] from [`Item`]s (what [`decode`] does with a [`StreamDecoder`]).
pub struct Collector {
    d: Decoded,
    acc: BTreeMap<u16, PcpuAcc>,
    keep_records: bool,
}

impl Default for Collector {
    fn default() -> Self {
        Self {
            d: Decoded::default(),
            acc: BTreeMap::new(),
            keep_records: true,
        }
    }
}

impl Collector {
    /// Nothing collected yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A collector that keeps only what describes the capture (header, block numbering, losses,
    /// damage, text) and drops the records: for callers that consume records as they are decoded.
    /// Its `PcpuLog::records` stay empty; its gaps carry the TSC bounds given to
    /// [`Collector::push_block_meta`].
    #[must_use]
    pub fn metadata_only() -> Self {
        Self {
            keep_records: false,
            ..Self::default()
        }
    }

    /// Takes a block's numbering, its record counts and the TSCs of its first and last records,
    /// without the records (see [`Collector::metadata_only`]).
    pub fn push_block_meta(
        &mut self,
        header: BlockHeader,
        samples: u64,
        events: u64,
        tsc: Option<(u64, u64)>,
    ) {
        self.d.frames += 1;
        let acc = self.acc.entry(header.pcpu).or_insert_with(|| PcpuAcc {
            sorted: true,
            ..PcpuAcc::default()
        });
        if !acc.seqs.insert(header.seq) {
            acc.duplicates += 1;
            return;
        }
        if acc.blocks.last().is_some_and(|b| b.h.seq > header.seq) {
            acc.sorted = false;
        }
        acc.blocks.push(BlockMeta {
            h: header,
            start: acc.records.len(),
            len: usize::try_from(samples + events).unwrap_or(usize::MAX),
            frames_start: 0,
            frames_len: 0,
            samples,
            tsc,
        });
    }

    /// Takes one item.
    pub fn push(&mut self, item: Item<'_>) {
        match item {
            Item::Header { header, .. } => {
                self.d.frames += 1;
                self.d.header_frames += 1;
                match &self.d.header {
                    None => self.d.header = Some(header.clone()),
                    Some(first) if first != header => self.d.header_conflicts += 1,
                    Some(_) => {}
                }
            }
            Item::Block {
                header,
                records,
                frames,
                ..
            } => {
                self.d.frames += 1;
                let acc = self.acc.entry(header.pcpu).or_insert_with(|| PcpuAcc {
                    sorted: true,
                    ..PcpuAcc::default()
                });
                if !acc.seqs.insert(header.seq) {
                    acc.duplicates += 1;
                    return;
                }
                if acc.blocks.last().is_some_and(|b| b.h.seq > header.seq) {
                    acc.sorted = false;
                }
                let samples = records
                    .iter()
                    .filter(|r| matches!(r, Record::Sample(_)))
                    .count() as u64;
                acc.blocks.push(BlockMeta {
                    h: header,
                    start: acc.records.len(),
                    len: records.len(),
                    frames_start: acc.frames.len(),
                    frames_len: frames.len(),
                    samples,
                    tsc: tsc_bounds(records),
                });
                if self.keep_records {
                    acc.records.extend_from_slice(records);
                    acc.frames.extend_from_slice(frames);
                }
            }
            Item::End { totals, .. } => {
                self.d.frames += 1;
                self.d.end = Some(totals.to_vec());
            }
            Item::Task { task, .. } => {
                self.d.frames += 1;
                self.d.tasks.push(task);
            }
            Item::VmEnd { vm_end, .. } => {
                self.d.frames += 1;
                self.d.vm_ends.push(vm_end.clone());
            }
            Item::PcpuCost { cost, .. } => {
                self.d.frames += 1;
                self.d.costs.push(cost);
            }
            Item::Mapping { mapping, .. } => {
                self.d.frames += 1;
                self.d.mappings.push(*mapping);
            }
            Item::Output { output, .. } => {
                self.d.frames += 1;
                if output.stream == OutputStream::Lost {
                    *self.d.output_lost.entry(output.vm).or_default() += output.lost;
                } else {
                    self.d
                        .output
                        .entry((output.vm, output.stream))
                        .or_default()
                        .extend_from_slice(output.bytes);
                }
            }
            Item::Unknown { .. } => {
                self.d.frames += 1;
                self.d.unknown_frames += 1;
            }
            Item::Text { offset, text } => self.d.text.push(TextSpan {
                offset,
                text: text.to_owned(),
            }),
            Item::Damage(d) => self.d.damaged.push(d),
        }
    }

    /// Orders each pCPU's blocks and computes the losses. `bytes`: the stream length.
    #[must_use]
    pub fn finish(mut self, bytes: u64) -> Decoded {
        self.d.bytes = bytes;
        let mut totals: BTreeMap<u16, PcpuTotals> = BTreeMap::new();
        for t in self.d.end.iter().flatten() {
            totals.insert(t.pcpu, *t);
        }
        for &pcpu in totals.keys() {
            self.acc.entry(pcpu).or_insert_with(|| PcpuAcc {
                sorted: true,
                ..PcpuAcc::default()
            });
        }
        for (pcpu, acc) in mem::take(&mut self.acc) {
            let log = finish_pcpu(pcpu, acc, totals.get(&pcpu).copied(), self.d.end.is_some());
            self.d.pcpus.insert(pcpu, log);
        }
        self.d
    }
}

fn tsc_bounds(records: &[Record]) -> Option<(u64, u64)> {
    Some((records.first()?.tsc(), records.last()?.tsc()))
}

fn finish_pcpu(pcpu: u16, mut acc: PcpuAcc, totals: Option<PcpuTotals>, end: bool) -> PcpuLog {
    if acc.records.is_empty() {
        // Metadata only: order the blocks; there are no records to move.
        if !acc.sorted {
            acc.blocks.sort_by_key(|b| b.h.seq);
        }
    } else if !acc.sorted {
        acc.blocks.sort_by_key(|b| b.h.seq);
        let mut records = Vec::with_capacity(acc.records.len());
        let mut frames = Vec::with_capacity(acc.frames.len());
        for b in &mut acc.blocks {
            let start = records.len();
            records.extend_from_slice(&acc.records[b.start..b.start + b.len]);
            b.start = start;
            let start = frames.len();
            frames.extend_from_slice(&acc.frames[b.frames_start..b.frames_start + b.frames_len]);
            b.frames_start = start;
        }
        acc.records = records;
        acc.frames = frames;
    }
    let mut log = PcpuLog {
        pcpu,
        blocks_received: acc.blocks.len() as u64,
        duplicate_blocks: acc.duplicates,
        totals,
        ..PcpuLog::default()
    };
    let (mut next_seq, mut next_sample, mut next_event) = (0u64, 0u64, 0u64);
    let mut drops = 0u64;
    let mut last_tsc: Option<u64> = None;
    // Records received so far (the index of the next block's first record).
    let mut at = 0usize;
    for b in &acc.blocks {
        let events = b.len as u64 - b.samples;
        let dropped = b.h.ring_drops.saturating_sub(drops);
        if b.h.seq > next_seq {
            if b.h.first_sample < next_sample || b.h.first_event < next_event {
                log.inconsistent_blocks += 1;
            }
        } else if b.h.first_sample != next_sample || b.h.first_event != next_event {
            log.inconsistent_blocks += 1;
        }
        if b.h.seq > next_seq || dropped > 0 {
            log.add_gap(Gap {
                pcpu,
                at_record: at,
                blocks: b.h.seq.saturating_sub(next_seq),
                samples: b.h.first_sample.saturating_sub(next_sample),
                events: b.h.first_event.saturating_sub(next_event),
                dropped,
                after_tsc: last_tsc,
                before_tsc: b.tsc.map(|t| t.0),
                truncated: false,
            });
        }
        next_seq = b.h.seq.saturating_add(1);
        next_sample = b.h.first_sample.saturating_add(b.samples);
        next_event = b.h.first_event.saturating_add(events);
        drops = drops.max(b.h.ring_drops);
        log.ring_drops = b.h.ring_drops;
        at = at.saturating_add(b.len);
        if let Some((_, last)) = b.tsc {
            last_tsc = Some(last);
        }
    }
    if let Some(t) = totals {
        if t.blocks > next_seq {
            if t.samples < next_sample || t.events < next_event {
                log.inconsistent_blocks += 1;
            }
        } else if t.blocks < next_seq || t.samples != next_sample || t.events != next_event {
            log.inconsistent_blocks += 1;
        }
        let dropped = t.ring_drops.saturating_sub(drops);
        if t.blocks > next_seq || dropped > 0 {
            log.add_gap(Gap {
                pcpu,
                at_record: at,
                blocks: t.blocks - next_seq.min(t.blocks),
                samples: t.samples.saturating_sub(next_sample),
                events: t.events.saturating_sub(next_event),
                dropped,
                after_tsc: last_tsc,
                before_tsc: None,
                truncated: false,
            });
        }
        log.ring_drops = t.ring_drops;
    } else if !end {
        // No end frame at all: whatever this pCPU recorded after its last block is unknown.
        log.add_gap(Gap {
            pcpu,
            at_record: at,
            after_tsc: last_tsc,
            truncated: true,
            ..Gap::default()
        });
    }
    log.records = acc.records;
    log.frames = acc.frames;
    log
}

/// A block [`decode_parallel`] visited: its header and the stream offset of its frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockAt {
    /// The block's header.
    pub header: BlockHeader,
    /// Stream offset of its frame (its first COBS code byte).
    pub offset: u64,
}

/// Reads single block frames again, by the offset [`decode_parallel`] gave: a second pass over
/// a capture that keeps nothing of the first but where each block is. Reuses its buffers.
pub struct BlockReader {
    scratch: Scratch,
}

impl Default for BlockReader {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockReader {
    /// A reader with empty buffers.
    #[must_use]
    pub fn new() -> Self {
        Self {
            scratch: StreamDecoder::new().scratch,
        }
    }

    /// The block whose frame starts at `offset` in `bytes`, decoded as the stream decoders
    /// decoded it there; `None` when no valid block frame starts there.
    pub fn block_at(
        &mut self,
        bytes: &[u8],
        offset: u64,
    ) -> Option<(BlockHeader, &[Record], &[u64])> {
        let start = usize::try_from(offset).ok()?;
        let rest = bytes.get(start..)?;
        let (end, at_eof) = match memchr::memchr(0, rest) {
            Some(z) => (z, false),
            None => (rest.len(), true),
        };
        if !is_candidate(rest, 0) {
            return None;
        }
        let raw = &rest[..end.min(MAX_FRAME_BYTES)];
        match self.scratch.frame(raw, at_eof) {
            Ok((Parsed::Block(header), _)) => {
                Some((header, &self.scratch.records, &self.scratch.frames))
            }
            _ => None,
        }
    }
}

/// What a part of the capture held, besides its records (see [`decode_parallel`]).
enum Meta {
    Header(Box<Header>, u64),
    Task(Task, u64),
    VmEnd(Box<VmEnd>, u64),
    PcpuCost(PcpuCost, u64),
    Mapping(Box<Mapping>, u64),
    /// VM, stream, lost count, bytes.
    Output(u16, OutputStream, u64, Vec<u8>, u64),
    Block(BlockHeader, u64, u64, Option<(u64, u64)>),
    End(Vec<PcpuTotals>, u64),
    Unknown(u64, u8),
    Text(u64, String),
    Damage(Damage),
}

/// Decodes a capture on `parts` threads, handing every block's records to `visit` on the thread
/// that decoded it, with that thread's accumulator (from `init`). Returns the capture's
/// description ([`Decoded`] without records: header, losses, damage, text) and the
/// accumulators, in capture order. The capture is split at `0x00` delimiters, so no frame is cut.
/// `visit` sees each block once, as [`decode`] keeps it: the first copy in the stream of a block
/// sent more than once (a capture with such duplicates is decoded twice), with where it is
/// ([`BlockAt`]: [`BlockReader`] reads it again from there). Never panics.
pub fn decode_parallel<A: Send>(
    bytes: &[u8],
    parts: usize,
    init: impl Fn() -> A + Sync,
    visit: impl Fn(&mut A, BlockAt, &[Record], &[u64]) + Sync,
) -> (Decoded, Vec<A>) {
    let bounds = part_bounds(bytes, parts);
    // Blocks whose records `visit` must not see: later copies of a block (same pCPU and
    // sequence number), by (part, block index in the part). Known only once every part is
    // decoded: a capture with duplicates is decoded twice, the second time skipping them.
    let mut skip: HashSet<(usize, usize)> = HashSet::default();
    loop {
        let results = decode_parts(bytes, &bounds, &init, &visit, &skip, true);
        let mut seen: HashSet<(u16, u64)> = HashSet::default();
        let mut later: HashSet<(usize, usize)> = HashSet::default();
        for (part, (_, meta)) in results.iter().enumerate() {
            let blocks = meta.iter().filter_map(|m| match m {
                Meta::Block(h, ..) => Some((h.pcpu, h.seq)),
                _ => None,
            });
            for (i, key) in blocks.enumerate() {
                if !seen.insert(key) {
                    later.insert((part, i));
                }
            }
        }
        if later == skip {
            return collect_parts(bytes, results);
        }
        skip = later;
    }
}

/// The capture's description without its blocks, on `parts` threads: its header, task, VM end,
/// pCPU cost, mapping and end frames, its text and its damage, as [`decode_parallel`] finds
/// them, for a first look at a capture (who ran, what was mapped) before its records are read.
/// A span that begins as a block frame and holds no other frame's start is skipped unread,
/// neither decoded nor its CRC checked (a damaged block is not counted as damage here); a block
/// frame in any other span is skipped once its CRC holds. Blocks are not counted, so the result
/// is no account of what was lost. Never panics.
#[must_use]
pub fn decode_metadata_parallel(bytes: &[u8], parts: usize) -> Decoded {
    let bounds = part_bounds(bytes, parts);
    let results = decode_parts(
        bytes,
        &bounds,
        &|| (),
        &|(): &mut (), _, _: &[Record], _: &[u64]| {},
        &HashSet::default(),
        false,
    );
    collect_parts(bytes, results).0
}

/// Where `bytes` is split into (at most 64) `parts`: the first 0x00 at or after each nominal
/// split point, so no frame is cut.
fn part_bounds(bytes: &[u8], parts: usize) -> Vec<usize> {
    let parts = parts.clamp(1, 64);
    let mut bounds = vec![0usize];
    for i in 1..parts {
        let from = (bytes.len() * i / parts).max(*bounds.last().unwrap_or(&0));
        let at = memchr::memchr(0, &bytes[from..]).map(|z| from + z);
        if let Some(at) = at {
            bounds.push(at);
        }
    }
    bounds.push(bytes.len());
    bounds.dedup();
    bounds
}

/// Decodes each part of `bytes` (between `bounds`) on a thread of its own, handing `visit` the
/// records of every block but those in `skip` (part, block index).
fn decode_parts<A: Send>(
    bytes: &[u8],
    bounds: &[usize],
    init: &(impl Fn() -> A + Sync),
    visit: &(impl Fn(&mut A, BlockAt, &[Record], &[u64]) + Sync),
    skip: &HashSet<(usize, usize)>,
    with_records: bool,
) -> Vec<(A, Vec<Meta>)> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = bounds
            .windows(2)
            .enumerate()
            .map(|(part, w)| {
                let (start, end) = (w[0], w[1]);
                scope.spawn(move || {
                    let mut acc = init();
                    let mut meta = Vec::new();
                    let mut block = 0usize;
                    let mut dec = StreamDecoder::starting_at(start as u64);
                    dec.scratch.records_wanted = with_records;
                    let mut sink = |item: Item<'_>| match item {
                        Item::Header { offset, header } => {
                            meta.push(Meta::Header(Box::new(header.clone()), offset));
                        }
                        // Metadata only: a block is neither read nor counted.
                        Item::Block { .. } if !with_records => {}
                        Item::Block {
                            header,
                            records,
                            frames,
                            offset,
                        } => {
                            if !skip.contains(&(part, block)) {
                                visit(&mut acc, BlockAt { header, offset }, records, frames);
                            }
                            block += 1;
                            let samples = records
                                .iter()
                                .filter(|r| matches!(r, Record::Sample(_)))
                                .count() as u64;
                            meta.push(Meta::Block(
                                header,
                                samples,
                                records.len() as u64 - samples,
                                tsc_bounds(records),
                            ));
                        }
                        Item::End { offset, totals } => {
                            meta.push(Meta::End(totals.to_vec(), offset))
                        }
                        Item::Task { offset, task } => meta.push(Meta::Task(task, offset)),
                        Item::VmEnd { offset, vm_end } => {
                            meta.push(Meta::VmEnd(Box::new(vm_end.clone()), offset));
                        }
                        Item::PcpuCost { offset, cost } => {
                            meta.push(Meta::PcpuCost(cost, offset));
                        }
                        Item::Mapping { offset, mapping } => {
                            meta.push(Meta::Mapping(Box::new(*mapping), offset));
                        }
                        Item::Output { offset, output } => meta.push(Meta::Output(
                            output.vm,
                            output.stream,
                            output.lost,
                            output.bytes.to_vec(),
                            offset,
                        )),
                        Item::Unknown { offset, frame_type } => {
                            meta.push(Meta::Unknown(offset, frame_type));
                        }
                        Item::Text { offset, text } => {
                            meta.push(Meta::Text(offset, text.to_owned()))
                        }
                        Item::Damage(d) => meta.push(Meta::Damage(d)),
                    };
                    dec.feed(&bytes[start..end], &mut sink);
                    // A part other than the last ends just before a 0x00, so what it holds after
                    // its last delimiter is a whole span.
                    dec.finish(&mut sink);
                    (acc, meta)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// The capture's description from the parts' items, and their accumulators.
fn collect_parts<A>(bytes: &[u8], results: Vec<(A, Vec<Meta>)>) -> (Decoded, Vec<A>) {
    let mut col = Collector::metadata_only();
    let mut accs = Vec::with_capacity(results.len());
    for (acc, meta) in results {
        for m in meta {
            match m {
                Meta::Header(h, offset) => col.push(Item::Header { offset, header: &h }),
                Meta::Block(h, samples, events, tsc) => {
                    col.push_block_meta(h, samples, events, tsc)
                }
                Meta::End(t, offset) => col.push(Item::End { offset, totals: &t }),
                Meta::Task(task, offset) => col.push(Item::Task { offset, task }),
                Meta::VmEnd(vm_end, offset) => col.push(Item::VmEnd {
                    offset,
                    vm_end: &vm_end,
                }),
                Meta::PcpuCost(cost, offset) => col.push(Item::PcpuCost { offset, cost }),
                Meta::Mapping(mapping, offset) => col.push(Item::Mapping {
                    offset,
                    mapping: &mapping,
                }),
                Meta::Output(vm, stream, lost, bytes, offset) => col.push(Item::Output {
                    offset,
                    output: Output {
                        vm,
                        stream,
                        lost,
                        bytes: &bytes,
                    },
                }),
                Meta::Unknown(offset, frame_type) => col.push(Item::Unknown { offset, frame_type }),
                Meta::Text(offset, text) => col.push(Item::Text {
                    offset,
                    text: &text,
                }),
                Meta::Damage(d) => col.push(Item::Damage(d)),
            }
        }
        accs.push(acc);
    }
    (col.finish(bytes.len() as u64), accs)
}

/// Decodes a whole capture. Never panics.
#[must_use]
pub fn decode(bytes: &[u8]) -> Decoded {
    let mut dec = StreamDecoder::new();
    let mut col = Collector::new();
    dec.feed(bytes, &mut |item| col.push(item));
    dec.finish(&mut |item| col.push(item));
    col.finish(dec.position())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::{encode_block, max_block_frame_len};
    use crate::types::Sample;

    /// The decoder's CRC (the crc32c crate's, in hardware where the CPU can) is the encoder's
    /// (table-driven), on every length and alignment the hardware path splits differently.
    #[test]
    fn decoder_crc_is_the_encoders() {
        let data: Vec<u8> = (0..4096u32)
            .map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[1])
            .collect();
        for start in 0..16 {
            for len in (0..300).chain([1000, 4000 - start]) {
                let d = &data[start..start + len];
                let want = crate::crc32c(d).to_le_bytes();
                assert!(crc_ok(d, &want), "start {start} len {len}");
                let mut wrong = want;
                wrong[len % 4] ^= 1;
                assert!(!crc_ok(d, &wrong));
            }
        }
        assert!(!crc_ok(b"123456789", &[0, 0, 0]), "a short CRC");
    }

    /// One block frame of `pcpu` with this numbering and one sample at `tsc`.
    fn block(pcpu: u16, seq: u64, first_sample: u64, tsc: u64) -> Vec<u8> {
        let h = BlockHeader {
            pcpu,
            seq,
            first_sample,
            first_event: 0,
            ring_drops: 0,
            period_ticks: 100,
        };
        let rec = [Record::Sample(Sample {
            tsc,
            ..Sample::default()
        })];
        let mut buf = vec![0u8; max_block_frame_len(1, 0)];
        let n = encode_block(&h, &rec, &[], &mut buf).unwrap();
        buf.truncate(n);
        buf
    }

    /// Block `seq` of pCPU 0 holding one sample per TSC in `tscs`, numbered as if every earlier
    /// block held as many, after `drops` ring drops.
    fn block_of(seq: u64, tscs: &[u64], drops: u64) -> Vec<u8> {
        let h = BlockHeader {
            pcpu: 0,
            seq,
            first_sample: seq * tscs.len() as u64,
            first_event: 0,
            ring_drops: drops,
            period_ticks: 10,
        };
        let rec: Vec<Record> = tscs
            .iter()
            .map(|&tsc| {
                Record::Sample(Sample {
                    tsc,
                    ..Sample::default()
                })
            })
            .collect();
        let mut buf = vec![0u8; max_block_frame_len(rec.len(), 0)];
        let n = encode_block(&h, &rec, &[], &mut buf).unwrap();
        buf.truncate(n);
        buf
    }

    /// Each loss is placed between the last record before it and the first after it: a lost
    /// block, samples the hypervisor dropped (its drop count rises between two blocks), and
    /// at the end what the end frame counts beyond the last block received.
    #[test]
    fn gaps_are_placed_in_host_time() {
        let mut bytes = Vec::new();
        bytes.extend(block_of(0, &[10, 20], 0));
        // Block 1 (TSC 30, 40) is lost.
        bytes.extend(block_of(2, &[50, 60], 0));
        bytes.extend(block_of(3, &[70, 80], 5));
        let mut end = vec![0u8; crate::max_end_frame_len(1)];
        let totals = [PcpuTotals {
            pcpu: 0,
            samples: 10,
            events: 0,
            ring_drops: 7,
            blocks: 5,
        }];
        let n = crate::encode_end(&totals, &mut end).unwrap();
        let gap = |at_record, blocks, samples, dropped, after: u64, before| Gap {
            pcpu: 0,
            at_record,
            blocks,
            samples,
            events: 0,
            dropped,
            after_tsc: Some(after),
            before_tsc: before,
            truncated: false,
        };
        let want = vec![
            gap(2, 1, 2, 0, 20, Some(50)),
            gap(4, 0, 0, 5, 60, Some(70)),
            gap(6, 1, 2, 2, 80, None),
        ];
        let mut whole = bytes.clone();
        whole.extend_from_slice(&end[..n]);
        let d = decode(&whole);
        assert_eq!(d.gaps().copied().collect::<Vec<_>>(), want);
        assert_eq!(d.pcpus[&0].samples_missing(), 2 + 5 + 2 + 2);
        // Decoding in parallel (no records kept) places them the same.
        for parts in [1, 3] {
            let (p, _) = decode_parallel(&whole, parts, || (), |_, _, _, _| ());
            assert_eq!(p.gaps().copied().collect::<Vec<_>>(), want, "{parts} parts");
        }
        // Without the end frame the last gap is the unknown end.
        let d = decode(&bytes);
        let last = d.gaps().last().copied().unwrap();
        assert!(last.truncated && last.after_tsc == Some(80) && last.before_tsc.is_none());
        assert_eq!((last.blocks, last.samples, last.dropped), (0, 0, 0));
    }

    /// A block sent again later (a replay, or a forgery with the same numbering): decoding in
    /// parallel visits only its first copy, wherever the parts are cut, as `decode` keeps it.
    #[test]
    fn parallel_decoding_visits_a_duplicated_block_once() {
        let mut bytes = Vec::new();
        for seq in 0..8 {
            bytes.extend(block_of(seq, &[seq * 100, seq * 100 + 50], 0));
        }
        // A forged copy of block 2 with other records, at the end.
        bytes.extend(block_of(2, &[7, 8], 0));
        let whole = decode(&bytes);
        assert_eq!(whole.pcpus[&0].duplicate_blocks, 1);
        for parts in 1..6 {
            let (d, accs) = decode_parallel(&bytes, parts, Vec::new, |acc, _, r, _| {
                acc.extend(r.iter().map(Record::tsc));
            });
            let visited: Vec<u64> = accs.into_iter().flatten().collect();
            let want: Vec<u64> = whole.pcpus[&0].records.iter().map(Record::tsc).collect();
            assert_eq!(visited, want, "{parts} parts");
            assert_eq!(d.pcpus[&0].duplicate_blocks, 1);
        }
    }

    /// Sequence 1/3/5 with first_sample u64::MAX-5 / 0 / u64::MAX-5: the two gaps each claim
    /// almost 2^64 lost samples. Their sum overflowed (a panic in debug builds); it saturates.
    #[test]
    fn loss_counters_saturate() {
        let mut bytes = Vec::new();
        for (seq, first, tsc) in [(1, u64::MAX - 5, 10), (3, 0, 20), (5, u64::MAX - 5, 30)] {
            bytes.extend(block(0, seq, first, tsc));
        }
        // A second pCPU with the same claim, so the capture-wide sums overflow too.
        bytes.extend(block(1, u64::MAX, u64::MAX, 40));
        let d = decode(&bytes);
        let log = &d.pcpus[&0];
        assert_eq!(log.blocks_received, 3);
        assert_eq!(log.blocks_lost, 3, "seq 0, 2 and 4");
        assert_eq!(log.samples_lost, u64::MAX);
        assert_eq!(log.inconsistent_blocks, 1, "block 3 goes back to sample 0");
        // Three lost ranges, then the unknown end (no end frame).
        assert_eq!(log.gaps.len(), 4);
        assert_eq!(log.gaps[0].samples, u64::MAX - 5);
        assert_eq!(log.gaps[1].samples, 0);
        assert_eq!(log.gaps[2].samples, u64::MAX - 6);
        assert!(log.gaps[3].truncated && log.gaps[3].after_tsc == Some(30));
        assert_eq!(log.samples_missing(), u64::MAX);
        assert_eq!(d.pcpus[&1].blocks_lost, u64::MAX);
        assert_eq!(d.blocks_lost(), u64::MAX);
        assert_eq!(d.samples_lost(), u64::MAX);
        assert_eq!(d.samples(), 4);
    }
}

#[cfg(test)]
mod stats_frame_tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any body behind a VM end or pCPU cost frame type is decoded or refused, never a
        /// panic, and a decoded one re-encodes to the same table (the parser's checks are the
        /// encoder's invariants).
        #[test]
        fn any_stats_body_is_decoded_or_refused(body in prop::collection::vec(any::<u8>(), 0..400)) {
            let mut v = VmEnd::default();
            if let Ok(n) = parse_vm_end(&body, &mut v) {
                prop_assert!(n <= body.len());
                let mut buf = vec![0u8; crate::MAX_VM_END_FRAME_LEN];
                let len = crate::encode_vm_end(&v, &mut buf).unwrap();
                prop_assert_eq!(&crate::decode(&buf[..len]).vm_ends, &vec![v]);
            }
            if let Ok((_, n)) = parse_pcpu_cost(&body) {
                prop_assert!(n <= body.len());
            }
            let mut m = Mapping::default();
            if let Ok(n) = parse_mapping(&body, &mut m) {
                prop_assert!(n <= body.len() && m.start < m.end);
                let mut buf = vec![0u8; crate::MAX_MAPPING_FRAME_LEN];
                let len = crate::encode_mapping(&m, &mut buf).unwrap();
                prop_assert_eq!(&crate::decode(&buf[..len]).mappings, &vec![m]);
            }
        }
    }

    #[test]
    fn vm_end_rows_out_of_order_or_empty_are_refused() {
        // vm 0, lstar 0, no offsets, other 0, 2 rows: reason 10 then reason 10 again.
        let mut body = vec![0, 0, 0, 0, 2];
        for _ in 0..2 {
            body.extend_from_slice(&[10, 1, 5, 5, 5, 0, 0]);
        }
        body.extend_from_slice(&[0, 0]);
        assert!(parse_vm_end(&body, &mut VmEnd::default()).is_err());
        // One row with a zero count.
        let body = [0, 0, 0, 0, 1, 10, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(parse_vm_end(&body, &mut VmEnd::default()).is_err());
        // A valid one: reason 10, one exit of 5 ticks in bucket 0.
        let body = [0, 0, 0, 0, 1, 10, 1, 5, 5, 5, 1, 0, 1, 0, 0];
        let mut v = VmEnd::default();
        assert_eq!(parse_vm_end(&body, &mut v), Ok(body.len()));
        assert_eq!(v.exits.reason(10).count, 1);
        assert_eq!(v.exits.reason(10).histogram[0], 1);
        // A frame from before pause-loop exiting: none.
        assert_eq!(v.pause_loop, None);
    }

    #[test]
    fn vm_end_vpmu_is_read_and_bad_ones_refused() {
        // vm 0, lstar 0, no offsets, other 0, no rows, no ports, ports_other 0, no ple.
        let head = [0u8, 0, 0, 0, 0, 0, 0, 0];
        let frame = |tail: &[u8]| [&head[..], tail].concat();
        let mut v = VmEnd::default();
        // A frame from before the virtual PMU, and vpmu 0: none.
        for body in [frame(&[]), frame(&[0])] {
            assert_eq!(parse_vm_end(&body, &mut v), Ok(body.len()));
            assert_eq!(v.vpmu, None);
        }
        // Domain, one vCPU (1): 300 guest ticks, 2 emulated, 5 hypervisor ticks, 1 PMI, 0, 0;
        // 3 exits of 9 ticks.
        let body = frame(&[2, 1, 1, 0xac, 0x02, 2, 5, 1, 0, 0, 3, 9]);
        assert_eq!(parse_vm_end(&body, &mut v), Ok(body.len()));
        let p = v.vpmu.unwrap();
        assert!(p.domain);
        assert_eq!(
            p.vcpus(),
            &[VpmuCounts {
                vcpu: 1,
                guest_ticks: 300,
                emulated: 2,
                hypervisor_ticks: 5,
                pmis: 1,
                held: 0,
                undelivered: 0,
                exits: 3,
                exit_ticks: 9
            }]
        );
        // The page-table isolation byte after it: absent (a frame from before it), 0, 1, 2.
        for (tail, want) in [
            (&[][..], None),
            (&[0][..], None),
            (&[1][..], Some(false)),
            (&[2][..], Some(true)),
        ] {
            let body = frame(&[&[0u8][..], tail].concat());
            assert_eq!(parse_vm_end(&body, &mut v), Ok(body.len()));
            assert_eq!(v.page_table_isolation, want, "{tail:?}");
        }
        // An unknown mode, no vCPU, too many, a cut frame, an unknown isolation value.
        for bad in [
            frame(&[0, 3]),
            frame(&[3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            frame(&[1, 0]),
            frame(&[1, 9]),
            frame(&[1, 1, 0, 5]),
        ] {
            assert!(
                parse_vm_end(&bad, &mut VmEnd::default()).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn vm_end_pause_loop_is_read_and_bad_ones_refused() {
        // vm 0, lstar 0, no offsets, other 0, no rows, no ports, ports_other 0.
        let head = [0u8, 0, 0, 0, 0, 0, 0];
        let frame = |tail: &[u8]| [&head[..], tail].concat();
        let mut v = VmEnd::default();
        // ple 0: none.
        let body = frame(&[0]);
        assert_eq!(parse_vm_end(&body, &mut v), Ok(body.len()));
        assert_eq!(v.pause_loop, None);
        // Directed, gap 128, window 4096, one site (vCPU 1, RIP 0x10, 3 exits), 2 others.
        let body = frame(&[2, 0x80, 0x01, 0x80, 0x20, 1, 1, 0x10, 3, 2]);
        assert_eq!(parse_vm_end(&body, &mut v), Ok(body.len()));
        let p = v.pause_loop.unwrap();
        assert_eq!(
            (p.directed, p.gap, p.window, p.others),
            (true, 128, 4096, 2)
        );
        assert_eq!(
            p.sites(),
            &[SpinSite {
                vcpu: 1,
                rip: 0x10,
                exits: 3
            }]
        );
        assert_eq!(p.exits(), 5);
        // An unknown mode, a site without exits, too many sites, a cut frame.
        for bad in [
            frame(&[3, 1, 1, 0, 0]),
            frame(&[1, 1, 1, 1, 0, 0x10, 0, 0]),
            frame(&[1, 1, 1, 65]),
            frame(&[1, 1, 1, 1, 0, 0x10]),
        ] {
            assert!(
                parse_vm_end(&bad, &mut VmEnd::default()).is_err(),
                "{bad:?}"
            );
        }
    }
}
