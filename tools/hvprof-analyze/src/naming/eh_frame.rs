//! Function bounds of a stripped file from its `.eh_frame`: every function compiled with unwind
//! tables (the default on x86-64, also in Debian's stripped libraries) has a frame description
//! entry whose range is the function's, symbol or not. A sample in a function that has no
//! symbol is then counted per function (`[unknown] file+0x<start>`, where the start is the
//! address in the file, as callgrind and `addr2line` give it), not per instruction.

use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, UnwindSection};
use object::{Object, ObjectSection};

/// The most entries read: a corrupt section cannot make the analyzer loop.
const MAX_ENTRIES: usize = 1 << 20;

/// The (start, end) address ranges of the functions `.eh_frame` describes, sorted, without
/// empty or duplicate ranges. An unreadable or malformed section gives what was read before
/// the damage.
pub fn function_ranges(file: &object::File) -> Vec<(u64, u64)> {
    let Some(section) = file.section_by_name(".eh_frame") else {
        return Vec::new();
    };
    let Ok(data) = section.data() else {
        return Vec::new();
    };
    let eh = EhFrame::new(data, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(section.address());
    if let Some(text) = file.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    if let Some(got) = file.section_by_name(".got") {
        bases = bases.set_got(got.address());
    }
    let mut out = Vec::new();
    let mut entries = eh.entries(&bases);
    for _ in 0..MAX_ENTRIES {
        let Ok(Some(entry)) = entries.next() else {
            break;
        };
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) =
            partial.parse(|section, bases, offset| section.cie_from_offset(bases, offset))
        else {
            continue;
        };
        let start = fde.initial_address();
        if let Some(end) = start.checked_add(fde.len())
            && end > start
        {
            out.push((start, end));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A function of the test program that keeps its symbol whatever the optimiser does with
    /// the tests around it (a test's own function may be inlined into the harness).
    #[unsafe(no_mangle)]
    #[inline(never)]
    extern "C" fn hvprof_eh_frame_test_marker(x: u64) -> u64 {
        std::hint::black_box(x).wrapping_mul(3)
    }

    #[test]
    fn a_host_library_has_one_range_per_function() {
        assert_eq!(hvprof_eh_frame_test_marker(std::hint::black_box(2)), 6);
        // Any ELF with unwind tables: this test program itself.
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let data = std::fs::read(&exe).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let ranges = function_ranges(&file);
        assert!(ranges.len() > 100, "{} ranges", ranges.len());
        assert!(ranges.windows(2).all(|w| w[0] < w[1]));
        assert!(ranges.iter().all(|(s, e)| s < e));
        // This function is one of them (by its symbol's address in the file).
        use object::ObjectSymbol;
        let sym = file
            .symbols()
            .find(|s| s.name().is_ok_and(|n| n == "hvprof_eh_frame_test_marker"))
            .expect("the test binary has symbols");
        assert!(
            ranges.iter().any(|&(s, e)| (s..e).contains(&sym.address())),
            "no range holds {:#x}",
            sym.address()
        );
    }

    #[test]
    fn garbage_gives_no_ranges_and_no_panic() {
        use object::write::{Object as Writer, StandardSection};
        let mut w = Writer::new(
            object::BinaryFormat::Elf,
            object::Architecture::X86_64,
            object::Endianness::Little,
        );
        let id = w.section_id(StandardSection::Text);
        w.append_section_data(id, &[0xc3; 16], 16);
        let eh = w.add_section(
            Vec::new(),
            b".eh_frame".to_vec(),
            object::SectionKind::ReadOnlyData,
        );
        for seed in 0..64u8 {
            let junk: Vec<u8> = (0..256u32)
                .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
                .collect();
            let mut w2 = Writer::new(
                object::BinaryFormat::Elf,
                object::Architecture::X86_64,
                object::Endianness::Little,
            );
            let eh2 = w2.add_section(
                Vec::new(),
                b".eh_frame".to_vec(),
                object::SectionKind::ReadOnlyData,
            );
            w2.append_section_data(eh2, &junk, 8);
            let bytes = w2.write().unwrap();
            let file = object::File::parse(&*bytes).unwrap();
            let _ = function_ranges(&file);
        }
        w.append_section_data(eh, &[0; 4], 4);
        let bytes = w.write().unwrap();
        let file = object::File::parse(&*bytes).unwrap();
        assert!(function_ranges(&file).is_empty());
    }
}
