//! `hvprof-analyze diff`: a capture against itself changes nothing; two different captures give
//! each side's shares as each one's own report gives them, and B minus A.

use std::process::Command;

use serde_json::Value;

use crate::data;

fn run(args: &[String]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_hvprof-analyze"))
        .args(args)
        .output()
        .expect("run hvprof-analyze");
    assert!(
        out.status.success(),
        "hvprof-analyze {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn names() -> Vec<String> {
    vec![
        "--hypervisor".into(),
        data("hvprof-3a995a71.sym").display().to_string(),
        "--image".into(),
        data("mix.elf").display().to_string(),
        "--no-search".into(),
    ]
}

fn diff(a: &str, b: &str) -> Value {
    let mut args = vec!["diff".to_owned(), data(a).display().to_string()];
    args.push(data(b).display().to_string());
    args.extend(names());
    args.push("--json".into());
    run(&args)
}

fn report(log: &str) -> Value {
    let mut args = vec!["report".to_owned(), data(log).display().to_string()];
    args.extend(names());
    args.push("--json".into());
    run(&args)
}

fn f(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

#[test]
fn a_capture_against_itself_changes_nothing() {
    let d = diff("sched-3vms-1pcpu.log", "sched-3vms-1pcpu.log");
    assert_eq!(d["vms"].as_array().unwrap().len(), 3);
    for vm in d["vms"].as_array().unwrap() {
        for row in vm["functions"].as_array().unwrap() {
            assert_eq!(f(row, "delta"), 0.0, "{row}");
            assert_eq!(row["a_samples"], row["b_samples"]);
        }
        for k in ["os", "user", "idle", "steal"] {
            assert_eq!(f(&vm[k], "delta"), 0.0);
        }
    }
}

#[test]
fn each_side_is_its_own_report_and_the_change_is_b_minus_a() {
    let (a, b) = ("sched-3vms-1pcpu.log", "sched-halt.log");
    let d = diff(a, b);
    let (ra, rb) = (report(a), report(b));
    assert!((f(&d["host"]["idle"], "a") - f(&ra["host"], "idle")).abs() < 1e-9);
    assert!((f(&d["host"]["idle"], "b") - f(&rb["host"], "idle")).abs() < 1e-9);
    assert!(f(&d["host"]["idle"], "delta") > 0.0, "sched-halt idles");
    for vm in d["vms"].as_array().unwrap() {
        let name = vm["name"].as_str().unwrap();
        let rows = vm["functions"].as_array().unwrap();
        // Largest change first.
        for w in rows.windows(2) {
            assert!(f(&w[0], "delta").abs() >= f(&w[1], "delta").abs());
        }
        for (side, r) in [("a", &ra), ("b", &rb)] {
            let Some(theirs) = r["vms"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == name)
            else {
                continue;
            };
            let total = f(theirs, "samples");
            for row in theirs["rows"].as_array().unwrap() {
                let mine = rows
                    .iter()
                    .find(|x| x["function"] == row["function"] && x["module"] == row["module"])
                    .expect("every row of the report in the diff");
                let want = 100.0 * f(row, "samples") / total;
                assert!((f(mine, &format!("{side}_percent")) - want).abs() < 1e-9);
            }
        }
        for row in rows {
            let delta = f(row, "b_percent") - f(row, "a_percent");
            assert!((f(row, "delta") - delta).abs() < 1e-9);
        }
    }
}
