//! `triad-bench`: Triad's load generator. See `triad-bench --help` and BENCHMARKS.md.
//!
//! Modes so far: `store` (appends straight through `triad-store`), `disk` (dd and
//! write+fdatasync baselines) and `table` (Markdown from result lines). Every run prints
//! its result as one JSON line on stdout; progress goes to stderr.

mod args;
mod disk;
mod report;
mod store_bench;
mod sys;

use std::io::Read;
use std::process::ExitCode;

use args::Command;

fn emit(v: &serde_json::Value, json_only: bool) {
    if !json_only {
        println!("{}", report::human(v));
    }
    println!("{}", report::result_line(v));
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let cmd = match args::parse(&argv) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("triad-bench: {e}\n\n{}", args::USAGE);
            return ExitCode::from(2);
        }
    };
    let res = match cmd {
        Command::Help => {
            print!("{}", args::USAGE);
            Ok(())
        }
        Command::Store(a) => store_bench::run(&a).map(|v| emit(&v, a.json)),
        Command::Disk(a) => disk::run(&a).map(|vs| {
            for v in &vs {
                emit(v, a.json);
            }
        }),
        Command::Table(file) => {
            let input = match file {
                Some(p) => std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display())),
                None => {
                    let mut s = String::new();
                    std::io::stdin()
                        .read_to_string(&mut s)
                        .map(|_| s)
                        .map_err(|e| format!("stdin: {e}"))
                }
            };
            input.map(|s| print!("{}", report::table(&s)))
        }
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("triad-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
