//! pprof export: a gzipped `profile.proto` (github.com/google/pprof, proto/profile.proto),
//! encoded with prost. The messages are written out here with `#[derive(prost::Message)]`
//! (field numbers and types as in profile.proto), so no `protoc` is needed.
//!
//! Values: `samples/count` and `cpu/nanoseconds` (one period each). Each sample's stack is its
//! function, then its process, then its VM (leaf first, as pprof wants), so `pprof -top` lists
//! functions and the flame graph groups VM → process → function; samples carry the labels `vm`,
//! `process`, `vcpu`, `cr3` and `pcpu`. One pprof sample per distinct (stack, labels), with its
//! counts. Lost records are samples with the one frame `[lost]` (values: the samples missing),
//! labelled `pcpu`, `lost_from_tsc` and `lost_to_tsc`, and a comment line per loss range.
//!
//! A sample with call chains has one location per frame of its whole stack, leaf first
//! (`whole_stack::whole_stack`): its function, its callers (each a function of its module), a cut
//! chain's `[truncated: ...]`, then the outer frames; a hypervisor sample on a vCPU's exit has
//! the hypervisor's frames, `[exit: REASON]`, the guest's frames from the exit's RIP out, then
//! its VM.

use std::io::Write;

use anyhow::{Context, Result};
use flate2::Compression;
use flate2::write::GzEncoder;
use prost::Message;
use rustc_hash::FxHashMap as HashMap;

use crate::model::interner::Interner;
use crate::model::profile::Profile;
use crate::model::progress::Progress;
use crate::model::samples::What;
use crate::model::whole_stack::{Part, WholeKey, part_name, whole_key, whole_stack};

/// The messages of profile.proto.
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "7")]
        pub drop_frames: i64,
        #[prost(int64, tag = "8")]
        pub keep_frames: i64,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
        #[prost(int64, tag = "4")]
        pub num_unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(int64, tag = "6")]
        pub build_id: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
        #[prost(bool, tag = "5")]
        pub is_folded: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
        #[prost(int64, tag = "3")]
        pub column: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

/// The function of the samples standing for lost records.
pub const LOST: &str = "[lost]";

/// The string table (index 0 is "").
struct Strings(Interner<String>);

impl Strings {
    /// The table, with room for `n` strings (made at its size: growing, it would hash every
    /// string again at each doubling, a cache miss each).
    fn new(n: usize) -> Self {
        let mut s = Strings(Interner::with_capacity(n));
        s.get("");
        s
    }

    fn get(&mut self, v: &str) -> i64 {
        i64::from(self.0.number(v, || v.to_owned()).0)
    }
}

/// Builds the pprof profile (not yet encoded).
pub fn build(p: &Profile, progress: &Progress) -> proto::Profile {
    let mut samples = Vec::new();
    let mut profile = build_with(p, progress, &mut |s| samples.push(s.clone()));
    profile.sample = samples;
    profile
}

/// Builds the pprof profile but its samples, which go to `sample` one by one, in order (one
/// `Sample` made again for each: its lists are not allocated per sample).
fn build_with(
    p: &Profile,
    progress: &Progress,
    sample: &mut dyn FnMut(&proto::Sample),
) -> proto::Profile {
    progress.phase("locations", None, "frames");
    // About a name per frame, and a few VM, process and module names.
    let mut strings = Strings::new(p.frames.len() + 64);
    let mut mappings: Vec<proto::Mapping> = Vec::new();
    // By the module's string number.
    let mut mapping_ids: HashMap<i64, u64> = HashMap::default();
    let mut functions: Vec<proto::Function> = Vec::new();
    let mut locations: Vec<proto::Location> = Vec::new();
    // (module, name) by their strings' numbers → location id (one function per location).
    let mut loc_ids: HashMap<(i64, i64), u64> = HashMap::default();
    // The last module's string number: frames in a row mostly share their module.
    let mut last_module: (String, i64) = (String::new(), strings.get(""));
    let mut location = |name: &str, module: &str, strings: &mut Strings| -> u64 {
        // The module's string first, as a new mapping would number it.
        let m = if last_module.0 == module {
            last_module.1
        } else {
            let m = strings.get(module);
            last_module = (module.to_owned(), m);
            m
        };
        let n = strings.get(name);
        if let Some(&id) = loc_ids.get(&(m, n)) {
            return id;
        }
        let mapping_id = if module.is_empty() {
            0
        } else {
            *mapping_ids.entry(m).or_insert_with(|| {
                let id = mappings.len() as u64 + 1;
                mappings.push(proto::Mapping {
                    id,
                    filename: m,
                    has_functions: true,
                    ..Default::default()
                });
                id
            })
        };
        let fid = functions.len() as u64 + 1;
        functions.push(proto::Function {
            id: fid,
            name: n,
            system_name: n,
            filename: m,
            start_line: 0,
        });
        let id = locations.len() as u64 + 1;
        locations.push(proto::Location {
            id,
            mapping_id,
            address: 0,
            line: vec![proto::Line {
                function_id: fid,
                line: 0,
                column: 0,
            }],
            is_folded: false,
        });
        loc_ids.insert((m, n), id);
        id
    };
    // Each frame's stack, leaf first. Its process's and VM's locations are a few hundred,
    // found in a table of their own (small, so in cache, unlike the string table's).
    let mut outer: HashMap<&str, u64> = HashMap::default();
    let mut stacks: Vec<Vec<u64>> = p
        .frames
        .iter()
        .map(|f| {
            let mut st = vec![location(&f.function, &f.module, &mut strings)];
            for name in [&f.process, &f.vm] {
                if !name.is_empty() {
                    st.push(
                        *outer
                            .entry(name.as_str())
                            .or_insert_with(|| location(name, "", &mut strings)),
                    );
                }
            }
            st
        })
        .collect();
    progress.phase("pprof", Some(p.samples.stacks().len() as u64), "stacks");
    let keys = [
        strings.get("vm"),
        strings.get("process"),
        strings.get("vcpu"),
        strings.get("cr3"),
        strings.get("pcpu"),
    ];
    // Stacks with chains: their locations, leaf first, per distinct whole stack (numbered
    // after the frames).
    let mut chained: HashMap<WholeKey, u32> = HashMap::default();
    // Each stack's guest process (its frame's).
    let mut process_of: Vec<&str> = p.frames.iter().map(|f| f.process.as_str()).collect();
    for s in p
        .samples
        .stacks()
        .iter()
        .filter(|s| s.count > 0 && s.calls != 0)
    {
        let next = (stacks.len()) as u32;
        chained.entry(whole_key(s)).or_insert_with(|| {
            let parts = whole_stack(p, s).unwrap_or_default();
            let st = parts
                .iter()
                .rev()
                .map(|part| match part {
                    Part::Leaf(f) => location(&f.function, &f.module, &mut strings),
                    Part::Site(i) => {
                        let f = p.calls.frame(*i);
                        location(&f.function, &f.module, &mut strings)
                    }
                    other => location(&part_name(p, other), "", &mut strings),
                })
                .collect();
            stacks.push(st);
            process_of.push(&p.frames[s.frame as usize].process);
            next
        });
    }
    // (stack, vm, vcpu, cr3, pcpu) → samples, from the distinct stacks.
    let mut counts: HashMap<(u32, u16, u16, u64, u16), i64> = HashMap::default();
    for s in p.samples.stacks().iter().filter(|s| s.count > 0) {
        let guest = matches!(s.what, What::GuestKernel | What::GuestUser);
        let stack = if s.calls == 0 {
            s.frame
        } else {
            chained[&whole_key(s)]
        };
        let key = (
            stack,
            s.vm,
            s.vcpu,
            if guest { s.cr3 } else { u64::MAX },
            s.pcpu,
        );
        *counts.entry(key).or_default() += s.count as i64;
    }
    let mut entries: Vec<_> = counts.into_iter().collect();
    entries.sort_unstable_by_key(|e| e.0);
    let period_ns = p.ticks_to_ns(p.period_ticks) as i64;
    let num = |key: i64, v: i64| proto::Label {
        key,
        num: v,
        ..Default::default()
    };
    // Each VM's and stack's process label's string, found once.
    let mut vm_str: HashMap<u16, i64> = HashMap::default();
    let mut process_str: Vec<Option<i64>> = vec![None; process_of.len()];
    let mut made = proto::Sample::default();
    for ((stack, vm, vcpu, cr3, pcpu), n) in entries {
        sample({
            let proto::Sample {
                location_id,
                value,
                label,
            } = &mut made;
            label.clear();
            if vm != hvprof_samplelog::NO_VM {
                label.push(proto::Label {
                    key: keys[0],
                    str: *vm_str
                        .entry(vm)
                        .or_insert_with(|| strings.get(&p.vm_name(vm))),
                    ..Default::default()
                });
                label.push(num(keys[2], i64::from(vcpu)));
            }
            if cr3 != u64::MAX {
                label.push(proto::Label {
                    key: keys[1],
                    str: *process_str[stack as usize]
                        .get_or_insert_with(|| strings.get(process_of[stack as usize])),
                    ..Default::default()
                });
                label.push(num(keys[3], cr3 as i64));
            }
            label.push(num(keys[4], i64::from(pcpu)));
            location_id.clear();
            location_id.extend_from_slice(&stacks[stack as usize]);
            value.clear();
            value.extend([n, n.saturating_mul(period_ns)]);
            &made
        });
    }
    // Lost records: per range, a sample of the samples missing with the stack `[lost]`,
    // labelled with its pCPU and TSC range, and a comment line.
    let lost_keys = [strings.get("lost_from_tsc"), strings.get("lost_to_tsc")];
    let mut lost_comments = Vec::new();
    for l in &p.losses {
        lost_comments.push(strings.get(&format!("records lost: {}", l.describe())));
        let n = l.samples_missing().min(i64::MAX as u64) as i64;
        if n == 0 {
            continue;
        }
        let mut label = vec![num(keys[4], i64::from(l.pcpu))];
        for (k, t) in lost_keys.iter().zip([l.from_tsc, l.to_tsc]) {
            if let Some(t) = t {
                label.push(num(*k, t as i64));
            }
        }
        sample(&proto::Sample {
            location_id: vec![location(LOST, "", &mut strings)],
            value: vec![n, n.saturating_mul(period_ns)],
            label,
        });
    }
    let (start, end) = p.span();
    let sample_type = vec![
        proto::ValueType {
            r#type: strings.get("samples"),
            unit: strings.get("count"),
        },
        proto::ValueType {
            r#type: strings.get("cpu"),
            unit: strings.get("nanoseconds"),
        },
    ];
    let mut comment = vec![strings.get(&format!(
        "hvprof: {} samples, {} pCPU(s), {} source, period {} TSC ticks, TSC {} Hz",
        p.samples.len(),
        p.pcpus,
        p.source,
        p.period_ticks,
        p.tsc_hz
    ))];
    comment.extend(lost_comments);
    let period_type = Some(proto::ValueType {
        r#type: strings.get("cpu"),
        unit: strings.get("nanoseconds"),
    });
    proto::Profile {
        sample_type,
        mapping: mappings,
        location: locations,
        function: functions,
        string_table: strings.0.values,
        duration_nanos: p.ticks_to_ns(end - start) as i64,
        period_type,
        period: period_ns,
        comment,
        ..Default::default()
    }
}

/// Writes the gzipped profile: the bytes of [`build`]'s profile encoded, its samples encoded
/// as they are made rather than kept as messages (a few vectors each).
pub fn write(p: &Profile, out: &mut dyn Write, progress: &Progress) -> Result<()> {
    let mut samples: Vec<u8> = Vec::new();
    let mut profile = build_with(p, progress, &mut |s| {
        prost::encoding::message::encode(2, s, &mut samples);
    });
    // A message's fields are encoded in the order of their tags, and empty ones left out: the
    // sample types (tag 1), the samples (2), then the rest.
    let sample_type = proto::Profile {
        sample_type: std::mem::take(&mut profile.sample_type),
        ..Default::default()
    };
    // The fastest level: a profile of many distinct addresses compresses at a few MB/s at the
    // default level, and the file is little larger.
    let mut gz = GzEncoder::new(out, Compression::fast());
    gz.write_all(&sample_type.encode_to_vec())
        .and_then(|()| gz.write_all(&samples))
        .and_then(|()| gz.write_all(&profile.encode_to_vec()))
        .and_then(|()| gz.try_finish())
        .context("cannot write the pprof profile")
}

/// Reads a gzipped (or plain) profile.proto.
pub fn read(bytes: &[u8]) -> Result<proto::Profile> {
    let raw = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(bytes), &mut v)
            .context("not a gzip stream")?;
        v
    } else {
        bytes.to_vec()
    };
    proto::Profile::decode(raw.as_slice()).context("not a profile.proto message")
}
