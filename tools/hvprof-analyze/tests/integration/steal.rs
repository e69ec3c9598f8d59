//! `[steal] (outside)` by who held the pCPU: three busy VMs taking turns on one pCPU (the
//! demo's setup) each lose their pCPU to the other two alike.

use std::process::Command;

use serde_json::Value;

use crate::data;

/// `hvprof-analyze CMD` on the three-VM capture with its symbols; its standard output.
fn analyze(cmd: &str, extra: &[&str]) -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"))
        .arg(cmd)
        .arg(data("sched-3vms-1pcpu.log"))
        .arg("--hypervisor")
        .arg(data("hvprof-3a995a71.sym"))
        .arg("--image")
        .arg(data("mix.elf"))
        .arg("--no-search")
        .args(extra)
        .output()
        .expect("run hvprof-analyze");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn three_vms_on_one_pcpu_steal_from_each_other_alike() {
    let r: Value = serde_json::from_slice(&analyze("report", &["--json"])).unwrap();
    let vms = r["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 3);
    for vm in vms {
        let name = vm["name"].as_str().unwrap();
        let outside: f64 = vm["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|row| row["function"] == "[steal]" && row["module"] == "(outside)")
            .map(|row| row["percent"].as_f64().unwrap())
            .sum();
        let by = vm["steal_by"].as_array().expect("steal_by");
        let total: f64 = by.iter().map(|b| b["percent"].as_f64().unwrap()).sum();
        assert!(
            (total - outside).abs() < 1e-6,
            "{name}: {total} against {outside}"
        );
        let others: Vec<f64> = by
            .iter()
            .filter(|b| b["name"] != name && b["vm"].is_u64())
            .filter(|b| !b["name"].as_str().unwrap().starts_with("the hypervisor"))
            .map(|b| b["percent"].as_f64().unwrap())
            .collect();
        assert_eq!(others.len(), 2, "{name}: {by:?}");
        // Each of the other two about half of it (round robin: a third of the time each).
        for share in &others {
            assert!(
                (share - outside / 2.0).abs() < 1.0,
                "{name}: {others:?} of {outside}"
            );
        }
    }
}

/// The HTML page has the matrix: a row per VM, a column per culprit, its own cell 0.
#[test]
fn the_html_page_says_who_stole_from_whom() {
    let html = analyze("html", &[]);
    let page = String::from_utf8_lossy(&html);
    let at = page
        .find("<h2 id=stolen>Who stole from whom</h2>")
        .expect("the matrix");
    let table = &page[at..at + page[at..].find("</table>").unwrap()];
    for vm in ["guestOS1", "guestOS2", "guestOS3"] {
        assert!(table.contains(&format!("<tr><td>{vm}</td>")), "{table}");
        assert!(table.contains(&format!("<th>{vm}</th>")), "{table}");
    }
    // guestOS1's row: guestOS1 (itself) 0.00, then the other two about a third each.
    let row = &table[table.find("<tr><td>guestOS1</td>").unwrap()..];
    let row = &row[..row.find("</tr>").unwrap()];
    let cells: Vec<f64> = row
        .split("<td class=n>")
        .skip(1)
        .map(|c| c.split('<').next().unwrap().parse().unwrap())
        .collect();
    assert!(cells[0] < 0.1, "{row}");
    assert!(
        (cells[1] - 32.7).abs() < 1.0 && (cells[2] - 32.7).abs() < 1.0,
        "{row}"
    );
}

/// The same split exactly from the scheduling events: each other VM's vCPU was in about a
/// third of the lifetime, as the samples say.
#[test]
fn the_events_agree_with_the_samples_on_who_stole() {
    let r: Value = serde_json::from_slice(&analyze("report", &["--json"])).unwrap();
    for vm in r["vms"].as_array().unwrap() {
        let name = vm["name"].as_str().unwrap();
        for b in vm["steal_by"].as_array().unwrap() {
            if b["vm"].is_null()
                || b["name"] == name
                || b["name"].as_str().unwrap().starts_with("the hypervisor")
            {
                continue;
            }
            let (samples, events) = (
                b["percent"].as_f64().unwrap(),
                b["events"].as_f64().unwrap(),
            );
            assert!((samples - events).abs() < 0.5, "{name}: {b}");
        }
    }
}

/// `report --stolen`: per vCPU, the other two VMs' vCPU 0 hold its pCPU about half of its
/// steal each, in the mix guest's functions; the per-pCPU matrix has a row per vCPU, its own
/// column empty.
#[test]
fn stolen_names_the_holders_and_their_functions() {
    let r: Value = serde_json::from_slice(&analyze("report", &["--json", "--stolen"])).unwrap();
    let stolen = &r["stolen"];
    let vcpus = stolen["vcpus"].as_array().expect("stolen.vcpus");
    assert_eq!(vcpus.len(), 3);
    for v in vcpus {
        let name = v["vm"].as_str().unwrap();
        let holders: Vec<(&str, f64)> = v["holders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| {
                (
                    h["holder"].as_str().unwrap(),
                    h["percent"].as_f64().unwrap(),
                )
            })
            .collect();
        let guests: Vec<&(&str, f64)> = holders
            .iter()
            .filter(|(h, _)| h.starts_with("guestOS"))
            .collect();
        assert_eq!(guests.len(), 2, "{name}: {holders:?}");
        for (h, share) in &guests {
            assert!(
                !h.starts_with(name),
                "{name} holds its own pCPU: {holders:?}"
            );
            assert!((share - 48.0).abs() < 4.0, "{name}: {holders:?}");
        }
        // The rows name the guest's functions (the mix guest's work_a first).
        let top = &v["rows"][0];
        assert!(
            top["holder"].as_str().unwrap().starts_with("guestOS"),
            "{top}"
        );
        assert_eq!(top["function"], "work_a", "{top}");
        // The module: the holder VM's own image (mixN.elf, the same program under each
        // VM's name).
        assert!(top["module"].as_str().unwrap().starts_with("mix"), "{top}");
    }
    let pcpus = stolen["pcpus"].as_array().unwrap();
    assert_eq!(pcpus.len(), 1);
    assert_eq!(pcpus[0]["victims"].as_array().unwrap().len(), 3);
    for c in pcpus[0]["cells"].as_array().unwrap() {
        let victim = c["victim"].as_str().unwrap();
        assert!(
            !victim.starts_with(&format!("{} ", c["holder"].as_str().unwrap())),
            "{c}"
        );
    }
    // The text view says the same.
    let text = String::from_utf8(analyze("report", &["--stolen"])).unwrap();
    assert!(text.contains("Stolen from: VM guestOS1 vCPU 0:"), "{text}");
    assert!(text.contains("Who stole from whom on pCPU 0"), "{text}");
}
