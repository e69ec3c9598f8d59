//! A user program's unwind table for the hypervisor (`hvprof_linux_walk::cfi`), evaluated from
//! its `.eh_frame` (the DWARF call-frame information of System V AMD64 ABI §6.2 and the LSB's
//! "Exception Frames") with `gimli`.
//!
//! Each row of each FDE's CFI table becomes one entry: where the caller's RSP is (RSP or RBP
//! plus an offset), and where the caller's RBP was saved. Rows the hypervisor's format cannot
//! express (a CFA computed by a DWARF expression, as in PLT stubs; a return address not at
//! CFA - 8; a signal trampoline) and the gaps between FDEs become "no rule" entries, where the
//! walk steps by the frame pointer; a row whose return address is undefined (`_start`'s
//! `cfi_undefined rip`) becomes the outermost frame.

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, EhFrame, LittleEndian, RegisterRule, UnwindContext,
    UnwindSection, X86_64,
};
use hvprof_linux_walk::cfi::{self, no_rule};
use hvprof_linux_walk::orc::{OrcEntry, kind, reg};
use object::{Object, ObjectSection, ObjectSegment};

use crate::Error;

/// What a table covers, for the user to see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The program's GNU build id, in hex.
    pub build_id: String,
    /// FDEs read (functions described).
    pub fdes: usize,
    /// Entries written.
    pub entries: usize,
    /// Of them, "no rule" entries (gaps and rows the format cannot express).
    pub no_rule: usize,
    /// `[start, end)`.
    pub start: u64,
    pub end: u64,
}

fn err(why: impl Into<String>) -> Error {
    Error::Unwind(why.into())
}

/// One CFI row as an entry.
fn entry_of<T: gimli::ReaderOffset>(
    cfa: &CfaRule<T>,
    ra: &RegisterRule<T>,
    rbp: &RegisterRule<T>,
) -> OrcEntry {
    if matches!(ra, RegisterRule::Undefined) {
        return no_rule(true);
    }
    if !matches!(ra, RegisterRule::Offset(-8)) {
        return no_rule(false);
    }
    let (sp_reg, offset) = match cfa {
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => {
            (reg::SP, *offset)
        }
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => {
            (reg::BP, *offset)
        }
        _ => return no_rule(false),
    };
    let Ok(sp_offset) = i16::try_from(offset) else {
        return no_rule(false);
    };
    let (bp_reg, bp_offset) = match rbp {
        RegisterRule::Offset(o) => match i16::try_from(*o) {
            Ok(o) => (reg::PREV_SP, o),
            Err(_) => return no_rule(false),
        },
        // Kept in place (or lost, which the walk cannot know better): unchanged.
        _ => (reg::UNDEFINED, 0),
    };
    OrcEntry {
        sp_offset,
        bp_offset,
        sp_reg,
        bp_reg,
        kind: kind::CALL,
        end: false,
    }
}

/// The build id's bytes and the address they are loaded at (the `.note.gnu.build-id` note's
/// descriptor: after the 12-byte note header and the 4-byte name "GNU\0").
fn build_id(file: &object::File<'_>) -> Result<(u64, Vec<u8>), Error> {
    let section = file
        .section_by_name(".note.gnu.build-id")
        .ok_or_else(|| err("no .note.gnu.build-id: link it with --build-id"))?;
    let data = section
        .data()
        .map_err(|e| err(format!(".note.gnu.build-id: {e}")))?;
    let word = |at: usize| {
        data.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    match (word(0), word(4), word(8), data.get(12..16)) {
        (Some(4), Some(len), Some(3), Some(b"GNU\0")) if (1..=cfi::MAX_ID).contains(&len) => {
            let id = data
                .get(16..16 + len)
                .ok_or_else(|| err(".note.gnu.build-id: truncated"))?;
            Ok((section.address() + 16, id.to_vec()))
        }
        _ => Err(err(
            ".note.gnu.build-id: not one GNU build id of 1 to 20 bytes",
        )),
    }
}

/// The unwind table of the static, non-PIE x86-64 program `elf`, and what it covers.
pub fn unwind_table(elf: &[u8]) -> Result<(Vec<u8>, Summary), Error> {
    let file = object::File::parse(elf).map_err(|e| err(format!("not an ELF file: {e}")))?;
    if file.architecture() != object::Architecture::X86_64 {
        return Err(err("not an x86-64 program"));
    }
    if file.kind() != object::ObjectKind::Executable {
        return Err(err(
            "not a static, non-PIE executable (a PIE or a shared library is loaded where the \
             kernel chooses, which the table cannot name; build with -static -no-pie)",
        ));
    }
    let (id_addr, id) = build_id(&file)?;
    let loaded = file.segments().any(|s| {
        let (a, len) = (s.address(), s.size());
        id_addr >= a && id_addr + id.len() as u64 <= a + len
    });
    if !loaded {
        return Err(err("the build id is not in a loaded segment"));
    }
    let eh = file
        .section_by_name(".eh_frame")
        .ok_or_else(|| err("no .eh_frame: build it with -fasynchronous-unwind-tables"))?;
    let data = eh.data().map_err(|e| err(format!(".eh_frame: {e}")))?;
    let section = EhFrame::new(data, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(eh.address());
    if let Some(text) = file.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    // Every row as [start, end) and its entry.
    let mut rows: Vec<(u64, u64, OrcEntry)> = Vec::new();
    let mut fdes = 0;
    let mut ctx = UnwindContext::new();
    let mut entries = section.entries(&bases);
    while let Some(e) = entries.next().map_err(|e| err(format!(".eh_frame: {e}")))? {
        let CieOrFde::Fde(partial) = e else { continue };
        let fde = partial
            .parse(EhFrame::cie_from_offset)
            .map_err(|e| err(format!(".eh_frame FDE: {e}")))?;
        if fde.len() == 0 {
            continue;
        }
        fdes += 1;
        if fde.is_signal_trampoline() {
            rows.push((fde.initial_address(), fde.end_address(), no_rule(false)));
            continue;
        }
        let mut table = fde
            .rows(&section, &bases, &mut ctx)
            .map_err(|e| err(format!(".eh_frame rows: {e}")))?;
        while let Some(row) = table
            .next_row()
            .map_err(|e| err(format!(".eh_frame rows: {e}")))?
        {
            let entry = entry_of(
                row.cfa(),
                &row.register(X86_64::RA),
                &row.register(X86_64::RBP),
            );
            rows.push((row.start_address(), row.end_address(), entry));
        }
    }
    if rows.is_empty() {
        return Err(err(".eh_frame describes no code"));
    }
    rows.sort_by_key(|r| r.0);
    // Entries at each row's start; "no rule" in the gaps; equal neighbours merged.
    let mut out: Vec<(u64, OrcEntry)> = Vec::with_capacity(rows.len());
    let mut reach = rows[0].0;
    for &(start, end, entry) in &rows {
        if start > reach {
            out.push((reach, no_rule(false)));
        }
        match out.last_mut() {
            Some(last) if last.0 == start => last.1 = entry,
            _ => out.push((start, entry)),
        }
        reach = reach.max(end);
    }
    out.dedup_by(|b, a| a.1 == b.1);
    let start = out[0].0;
    let end = reach;
    if end > cfi::USER_END || end - start > u64::from(u32::MAX) {
        return Err(err("the code is not in the user half or spans over 4 GiB"));
    }
    let mut bytes = vec![0u8; cfi::encoded_len(out.len(), start, end)];
    let n = cfi::encode(id_addr, &id, start, end, &out, &mut bytes)
        .map_err(|e| err(format!("writing the table: {e}")))?;
    bytes.truncate(n);
    let summary = Summary {
        build_id: id.iter().map(|b| format!("{b:02x}")).collect(),
        fdes,
        entries: out.len(),
        no_rule: out
            .iter()
            .filter(|(_, e)| e.sp_reg == reg::UNDEFINED && !e.end)
            .count(),
        start,
        end,
    };
    Ok((bytes, summary))
}
