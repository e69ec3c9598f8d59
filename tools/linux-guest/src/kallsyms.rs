//! The kernel's own symbol table, `kallsyms`, decoded from a stripped vmlinux.
//!
//! `scripts/kallsyms.c` emits these tables into `.rodata`, each label aligned to 8 bytes:
//!
//! ```text
//! [kallsyms_offsets: i32 × N, kallsyms_relative_base: u64]   (6.1 and earlier)
//! kallsyms_num_syms: u32
//! kallsyms_names: N × (len: 1 or 2 bytes ULEB128, len token indices)
//! kallsyms_markers: u32 × ceil(N / 256)       offset in names of every 256th symbol
//! [kallsyms_seqs_of_names: 3 bytes × N]        6.2+, and backported to Debian's 6.1
//! kallsyms_token_table: 256 NUL-terminated strings
//! kallsyms_token_index: u16 × 256             offset of each token in the table
//! [kallsyms_offsets, kallsyms_relative_base]   (later kernels)
//! ```
//!
//! A symbol's expanded name starts with its type letter (`T`, `t`, `D`, ...). Nothing is
//! exported by name in a stripped image, so the tables are found by their shape: the token
//! index (256 increasing u16 starting at 0) right after a token table of 256 printable strings,
//! then a `num_syms` from which the names walk exactly to the markers, and an offsets array
//! whose decoded addresses are sorted. Every candidate is validated before use.

use crate::Error;
use crate::bzimage::{le16, le32, le64};

/// One kernel symbol, at its link-time (unrandomized) address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symbol {
    pub address: u64,
    /// The `nm`-style type letter: `T`/`t` text, `D`/`d` data, `B`/`b` bss, `R`/`r` read-only.
    pub kind: char,
    pub name: String,
}

/// What [`Kallsyms::lookup`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit<'a> {
    pub symbol: &'a Symbol,
    /// `address - symbol.address`.
    pub offset: u64,
    /// Distance to the next symbol at a higher address (None for the last one).
    pub size: Option<u64>,
}

/// Where the tables were found (addresses), for diagnostics. Serialized with hex addresses.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TableLayout {
    #[serde(serialize_with = "hex")]
    pub num_syms: u64,
    #[serde(serialize_with = "hex")]
    pub names: u64,
    #[serde(serialize_with = "hex")]
    pub markers: u64,
    #[serde(serialize_with = "hex_opt")]
    pub seqs_of_names: Option<u64>,
    #[serde(serialize_with = "hex")]
    pub token_table: u64,
    #[serde(serialize_with = "hex")]
    pub token_index: u64,
    #[serde(serialize_with = "hex")]
    pub offsets: u64,
    #[serde(serialize_with = "hex")]
    pub relative_base: u64,
    /// Whether non-negative offsets are absolute (per-CPU) addresses
    /// (`CONFIG_KALLSYMS_ABSOLUTE_PERCPU`).
    pub absolute_percpu: bool,
}

fn hex<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#x}"))
}

fn hex_opt<S: serde::Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => hex(v, s),
        None => s.serialize_none(),
    }
}

/// The decoded symbol table.
#[derive(Clone, Debug)]
pub struct Kallsyms {
    /// All symbols in table order, which is by address.
    symbols: Vec<Symbol>,
    /// Index of the first symbol at or above `relative_base` (the kernel image proper); the ones
    /// before it are per-CPU offsets.
    first_kernel: usize,
    layout: TableLayout,
}

const ALIGN: usize = 8;
const MAX_SYMS: u32 = 4_000_000;

fn align_up(x: usize) -> usize {
    x.next_multiple_of(ALIGN)
}

impl Kallsyms {
    /// Finds and decodes the kallsyms tables in `data`, a section (normally `.rodata`) whose first
    /// byte is at virtual address `base`. `base` must be 8-byte aligned.
    pub fn find(data: &[u8], base: u64) -> Result<Self, Error> {
        let mut tried = 0usize;
        let mut last_error = None;
        for tokens in token_tables(data) {
            tried += 1;
            match decode_at(data, base, &tokens) {
                Ok(k) => return Ok(k),
                Err(e) => last_error = Some(e),
            }
        }
        Err(Error::Kallsyms(match last_error {
            None => "no kallsyms token table/index pair found (is CONFIG_KALLSYMS set?)".into(),
            Some(e) => format!(
                "{tried} token table candidate(s) found, none led to valid names and offsets; last: {e}"
            ),
        }))
    }

    pub fn symbols(&self) -> &[Symbol] {
        &self.symbols
    }

    /// The symbols of the kernel image proper (not the per-CPU offsets), by address.
    pub fn kernel_symbols(&self) -> &[Symbol] {
        &self.symbols[self.first_kernel..]
    }

    /// The per-CPU symbols: their "address" is the offset in each CPU's per-CPU area.
    pub fn percpu_symbols(&self) -> &[Symbol] {
        &self.symbols[..self.first_kernel]
    }

    pub fn layout(&self) -> &TableLayout {
        &self.layout
    }

    /// The first symbol of this name (kernel symbols first, then per-CPU ones).
    pub fn by_name(&self, name: &str) -> Option<&Symbol> {
        self.kernel_symbols()
            .iter()
            .chain(self.percpu_symbols())
            .find(|s| s.name == name)
    }

    /// The kernel symbol containing `address` (a link-time address: subtract the KASLR slide
    /// first): the last symbol at or below it, sized to the next symbol at a higher address.
    /// None below the first kernel symbol.
    pub fn lookup(&self, address: u64) -> Option<Hit<'_>> {
        let syms = self.kernel_symbols();
        let n = syms.partition_point(|s| s.address <= address);
        if n == 0 {
            return None;
        }
        let symbol = &syms[n - 1];
        let size = syms[n..]
            .iter()
            .find(|s| s.address > symbol.address)
            .map(|s| s.address - symbol.address);
        Some(Hit {
            symbol,
            offset: address - symbol.address,
            size,
        })
    }
}

/// A token table + index candidate.
struct Tokens {
    table: usize,
    index: usize,
    strings: Vec<Vec<u8>>,
}

/// Every position in `data` holding a plausible token index preceded by its token table.
fn token_tables(data: &[u8]) -> impl Iterator<Item = Tokens> + '_ {
    (0..(data.len() + 1).saturating_sub(512))
        .step_by(ALIGN)
        .filter_map(move |p| token_table_at(data, p))
}

fn token_table_at(data: &[u8], p: usize) -> Option<Tokens> {
    if le16(data, p) != 0 {
        return None;
    }
    let idx: Vec<usize> = (0..256)
        .map(|i| usize::from(le16(data, p + 2 * i)))
        .collect();
    if idx.windows(2).any(|w| w[1] <= w[0] || w[1] - w[0] > 255) {
        return None;
    }
    // The table ends right before the index, padded with up to 7 zero bytes; the last token is
    // at most 254 bytes long.
    let mut best = None;
    for last_len in 0..255usize {
        let len = idx[255] + last_len + 1;
        let Some(table) = p.checked_sub(align_up(len)) else {
            break;
        };
        if table % ALIGN != 0 {
            continue;
        }
        if data[table + len - 1] != 0 || data[table + len..p].iter().any(|&b| b != 0) {
            continue;
        }
        if let Some(strings) = token_strings(data, table, &idx, len) {
            best = Some(Tokens {
                table,
                index: p,
                strings,
            });
            break;
        }
    }
    best
}

fn token_strings(data: &[u8], table: usize, idx: &[usize], len: usize) -> Option<Vec<Vec<u8>>> {
    let mut strings = Vec::with_capacity(256);
    let mut non_empty = 0;
    for i in 0..256 {
        let start = table + idx[i];
        let end = if i == 255 {
            table + len
        } else {
            table + idx[i + 1]
        } - 1;
        let s = &data[start..end];
        if data[end] != 0 || s.iter().any(|&c| !(0x20..0x7f).contains(&c)) {
            return None;
        }
        non_empty += usize::from(!s.is_empty());
        strings.push(s.to_vec());
    }
    (non_empty >= 128).then_some(strings)
}

fn decode_at(data: &[u8], base: u64, tokens: &Tokens) -> Result<Kallsyms, Error> {
    let bad = |what: String| Error::Kallsyms(what);
    // Scan backwards from the token table for num_syms.
    let mut q = tokens.table;
    let mut reason = String::from("no num_syms candidate before the token table");
    while q >= ALIGN {
        q -= ALIGN;
        let n = le32(data, q);
        if n == 0 || n > MAX_SYMS {
            continue;
        }
        match names_at(data, q, n as usize, tokens) {
            Ok(Some(found)) => {
                return offsets_for(data, base, tokens, found)
                    .map_err(|e| bad(format!("names found at {:#x}: {e}", base + q as u64)));
            }
            Ok(None) => {}
            Err(e) => reason = e,
        }
    }
    Err(bad(reason))
}

struct Names {
    num_syms: usize,
    count_at: usize,
    names: usize,
    markers: usize,
    seqs: Option<usize>,
    /// Expanded names, type letter first.
    expanded: Vec<Vec<u8>>,
}

/// Checks the names/markers layout for `n` symbols counted at `q`; cheap checks first.
fn names_at(data: &[u8], q: usize, n: usize, tokens: &Tokens) -> Result<Option<Names>, String> {
    let m = n.div_ceil(256);
    let names = align_up(q + 4);
    // Markers end right before the token table, or before seqs_of_names (3 bytes per symbol).
    let mut layouts = vec![(tokens.table.checked_sub(align_up(4 * m)), None)];
    if let Some(seqs) = tokens.table.checked_sub(align_up(3 * n)) {
        layouts.push((seqs.checked_sub(align_up(4 * m)), Some(seqs)));
    }
    for (markers, seqs) in layouts {
        let Some(markers) = markers else { continue };
        if markers <= names {
            continue;
        }
        if le32(data, markers) != 0 {
            continue;
        }
        let marks: Vec<usize> = (0..m)
            .map(|i| le32(data, markers + 4 * i) as usize)
            .collect();
        if marks.windows(2).any(|w| w[1] <= w[0]) {
            continue;
        }
        if marks[m - 1] >= markers - names {
            continue;
        }
        // Walk the names, checking every 256th against its marker.
        let mut pos = names;
        let mut expanded = Vec::with_capacity(n);
        let mut ok = true;
        for i in 0..n {
            if i % 256 == 0 && pos - names != marks[i / 256] {
                ok = false;
                break;
            }
            let Some((len, hdr)) = entry_len(data, pos, markers) else {
                ok = false;
                break;
            };
            let body = pos + hdr;
            if len == 0 || body + len > markers {
                ok = false;
                break;
            }
            let mut name = Vec::new();
            for &t in &data[body..body + len] {
                name.extend_from_slice(&tokens.strings[usize::from(t)]);
            }
            expanded.push(name);
            pos = body + len;
        }
        if !ok || align_up(pos) != markers {
            continue;
        }
        if expanded
            .iter()
            .any(|e| e.len() < 2 || !e[0].is_ascii_alphabetic())
        {
            return Err(format!(
                "{n} names walk to the markers but some have no type letter"
            ));
        }
        return Ok(Some(Names {
            num_syms: n,
            count_at: q,
            names,
            markers,
            seqs,
            expanded,
        }));
    }
    Ok(None)
}

/// A name entry's length: one byte, or two (ULEB128) when the first has bit 7 set (6.1+).
fn entry_len(data: &[u8], pos: usize, limit: usize) -> Option<(usize, usize)> {
    let b0 = usize::from(*data.get(pos)?);
    if b0 & 0x80 == 0 {
        return Some((b0, 1));
    }
    if pos + 1 >= limit {
        return None;
    }
    let b1 = usize::from(data[pos + 1]);
    Some(((b0 & 0x7f) | (b1 << 7), 2))
}

fn offsets_for(data: &[u8], base: u64, tokens: &Tokens, names: Names) -> Result<Kallsyms, String> {
    let n = names.num_syms;
    let span = align_up(4 * n);
    // Before num_syms: offsets, then relative_base right before the count.
    let mut candidates = Vec::new();
    if let Some(relbase) = names.count_at.checked_sub(ALIGN)
        && let Some(offsets) = relbase.checked_sub(span)
    {
        candidates.push((offsets, relbase));
    }
    // After the token index.
    let offsets = align_up(tokens.index + 512);
    candidates.push((offsets, offsets + span));
    for (offsets, relbase) in candidates {
        if relbase + 8 > data.len() {
            continue;
        }
        let relative_base = le64(data, relbase);
        if relative_base < 0xffff_8000_0000_0000 {
            continue;
        }
        let raw: Vec<i32> = (0..n).map(|i| le32(data, offsets + 4 * i) as i32).collect();
        for absolute_percpu in [true, false] {
            let addrs: Vec<u64> = raw
                .iter()
                .map(|&o| decode_offset(o, relative_base, absolute_percpu))
                .collect();
            if addrs.windows(2).any(|w| w[1] < w[0]) {
                continue;
            }
            let symbols: Vec<Symbol> = addrs
                .iter()
                .zip(&names.expanded)
                .map(|(&address, e)| Symbol {
                    address,
                    kind: char::from(e[0]),
                    name: String::from_utf8_lossy(&e[1..]).into_owned(),
                })
                .collect();
            let first_kernel = symbols.partition_point(|s| s.address < relative_base);
            let at = |off: usize| base + off as u64;
            return Ok(Kallsyms {
                symbols,
                first_kernel,
                layout: TableLayout {
                    num_syms: at(names.count_at),
                    names: at(names.names),
                    markers: at(names.markers),
                    seqs_of_names: names.seqs.map(at),
                    token_table: at(tokens.table),
                    token_index: at(tokens.index),
                    offsets: at(offsets),
                    relative_base,
                    absolute_percpu,
                },
            });
        }
    }
    Err("no kallsyms_offsets array before num_syms or after the token index decodes to sorted addresses".into())
}

fn decode_offset(o: i32, relative_base: u64, absolute_percpu: bool) -> u64 {
    if !absolute_percpu {
        return relative_base.wrapping_add(u64::from(o as u32));
    }
    if o >= 0 {
        o as u64
    } else {
        relative_base.wrapping_sub(1).wrapping_sub(o as i64 as u64)
    }
}

/// Builds kallsyms tables the way `scripts/kallsyms.c` lays them out, for tests.
#[doc(hidden)]
pub mod synth {
    /// Layout variants.
    #[derive(Clone, Copy, Debug)]
    pub struct Options {
        /// Offsets before num_syms (6.1) instead of after the token index.
        pub offsets_first: bool,
        /// Emit kallsyms_seqs_of_names.
        pub seqs: bool,
    }

    fn pad(v: &mut Vec<u8>) {
        while !v.len().is_multiple_of(8) {
            v.push(0);
        }
    }

    /// Tables for `syms` (address, "Tname"), sorted by address, per-CPU ones (< base) first,
    /// inside `prefix` junk bytes. Tokens: token i for printable i is that character; a few
    /// multi-character tokens replace unused bytes.
    pub fn build(syms: &[(u64, &str)], relative_base: u64, prefix: usize, opt: Options) -> Vec<u8> {
        let mut tokens: Vec<Vec<u8>> = (0..256u32)
            .map(|i| {
                if (0x21..0x7f).contains(&i) {
                    vec![i as u8]
                } else if i >= 0x80 {
                    format!("q{i}").into_bytes()
                } else {
                    Vec::new()
                }
            })
            .collect();
        tokens[1] = b"entry_".to_vec();
        tokens[2] = b"sched".to_vec();
        tokens[3] = b"_64".to_vec();
        tokens[4] = b"do_".to_vec();
        let encode = |name: &str| -> Vec<u8> {
            let b = name.as_bytes();
            let mut out = Vec::new();
            let mut i = 0;
            'outer: while i < b.len() {
                for (t, token) in tokens.iter().enumerate().take(5).skip(1) {
                    if b[i..].starts_with(token) {
                        out.push(t as u8);
                        i += token.len();
                        continue 'outer;
                    }
                }
                out.push(b[i]);
                i += 1;
            }
            out
        };
        let mut v: Vec<u8> = (0..prefix).map(|i| (i * 31 % 251) as u8).collect();
        pad(&mut v);
        let offsets = |v: &mut Vec<u8>| {
            for &(a, _) in syms {
                let o: i32 = if a < relative_base {
                    a as i32
                } else {
                    -((a - relative_base) as i32) - 1
                };
                v.extend_from_slice(&o.to_le_bytes());
            }
            pad(v);
            v.extend_from_slice(&relative_base.to_le_bytes());
        };
        if opt.offsets_first {
            offsets(&mut v);
        }
        v.extend_from_slice(&(syms.len() as u32).to_le_bytes());
        pad(&mut v);
        let names_start = v.len();
        let mut markers = Vec::new();
        for (i, &(_, name)) in syms.iter().enumerate() {
            if i % 256 == 0 {
                markers.push((v.len() - names_start) as u32);
            }
            let e = encode(name);
            if e.len() < 0x80 {
                v.push(e.len() as u8);
            } else {
                v.push((e.len() as u8 & 0x7f) | 0x80);
                v.push((e.len() >> 7) as u8);
            }
            v.extend_from_slice(&e);
        }
        pad(&mut v);
        for m in markers {
            v.extend_from_slice(&m.to_le_bytes());
        }
        pad(&mut v);
        if opt.seqs {
            for i in 0..syms.len() {
                v.extend_from_slice(&(i as u32).to_be_bytes()[1..]);
            }
            pad(&mut v);
        }
        let mut index = Vec::new();
        let table_start = v.len();
        for t in &tokens {
            index.push((v.len() - table_start) as u16);
            v.extend_from_slice(t);
            v.push(0);
        }
        pad(&mut v);
        for i in index {
            v.extend_from_slice(&i.to_le_bytes());
        }
        pad(&mut v);
        if !opt.offsets_first {
            offsets(&mut v);
        }
        v.extend((0..prefix).map(|i| (i * 17 % 253) as u8));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::synth::{Options, build};
    use super::*;

    const BASE: u64 = 0xffff_ffff_8100_0000;

    fn sample() -> Vec<(u64, String)> {
        let mut syms = vec![
            (0x0, "Dfixed_percpu_data".to_string()),
            (0x1fbc0, "Dcurrent_task".to_string()),
            (BASE, "T_text".to_string()),
            (BASE, "Tstartup_64".to_string()),
            (BASE + 0x1000, "Tdo_syscall_64".to_string()),
            (BASE + 0x1100, "tdo_one".to_string()),
            (BASE + 0x2000, "Tschedule".to_string()),
            (BASE + 0x2400, "Tentry_SYSCALL_64".to_string()),
        ];
        // Enough symbols for several markers, and one long ("big") name.
        for i in 0..700u64 {
            syms.push((BASE + 0x10000 + 0x40 * i, format!("tfiller_{i}")));
        }
        syms.push((BASE + 0x100000, format!("T{}", "x".repeat(200))));
        syms
    }

    fn decode(opt: Options) -> Kallsyms {
        let syms = sample();
        let refs: Vec<(u64, &str)> = syms.iter().map(|(a, n)| (*a, n.as_str())).collect();
        let data = build(&refs, BASE, 1000, opt);
        Kallsyms::find(&data, 0xffff_ffff_8200_0000).unwrap()
    }

    #[test]
    fn finds_every_layout_and_names_match() {
        for offsets_first in [true, false] {
            for seqs in [true, false] {
                let k = decode(Options {
                    offsets_first,
                    seqs,
                });
                assert_eq!(k.symbols().len(), 709, "{offsets_first} {seqs}");
                assert_eq!(k.layout().seqs_of_names.is_some(), seqs);
                assert!(k.layout().absolute_percpu);
                assert_eq!(k.layout().relative_base, BASE);
                let s = k.by_name("entry_SYSCALL_64").unwrap();
                assert_eq!((s.address, s.kind), (BASE + 0x2400, 'T'));
                assert_eq!(k.by_name("do_one").unwrap().kind, 't');
                assert_eq!(k.by_name("current_task").unwrap().address, 0x1fbc0);
                assert_eq!(k.percpu_symbols().len(), 2);
                assert_eq!(
                    k.by_name(&"x".repeat(200)).unwrap().address,
                    BASE + 0x100000
                );
            }
        }
    }

    #[test]
    fn lookup_sizes_to_the_next_higher_symbol() {
        let k = decode(Options {
            offsets_first: true,
            seqs: true,
        });
        let hit = k.lookup(BASE + 0x1010).unwrap();
        assert_eq!(hit.symbol.name, "do_syscall_64");
        assert_eq!((hit.offset, hit.size), (0x10, Some(0x100)));
        // Two symbols at the same address: the later one in table order, sized past both.
        let hit = k.lookup(BASE + 4).unwrap();
        assert_eq!(hit.symbol.name, "startup_64");
        assert_eq!(hit.size, Some(0x1000));
        // Per-CPU offsets are not kernel addresses.
        assert!(k.lookup(0x1fbc0).is_none());
        assert_eq!(k.lookup(BASE + 0x200000).unwrap().size, None);
    }

    #[test]
    fn missing_tables_are_reported() {
        let e = Kallsyms::find(&vec![0x55; 4096], 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no kallsyms token table"), "{e}");
    }

    #[test]
    fn unsorted_offsets_are_refused() {
        let syms = sample();
        let mut refs: Vec<(u64, &str)> = syms.iter().map(|(a, n)| (*a, n.as_str())).collect();
        refs.swap(3, 6);
        let data = build(
            &refs,
            BASE,
            64,
            Options {
                offsets_first: true,
                seqs: true,
            },
        );
        let e = Kallsyms::find(&data, 0).unwrap_err().to_string();
        assert!(e.contains("sorted"), "{e}");
    }
}
