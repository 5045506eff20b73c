//! `triad-bench`: Triad's load generator. See `triad-bench --help` and BENCHMARKS.md.
//!
//! Modes: `store` (appends straight through `triad-store`), `disk` (dd and
//! write+fdatasync baselines), `table` (Markdown from result lines), and the end-to-end
//! broker benchmarks `amqp`, `stomp`, `mqtt`, `mqtt-idle`, `stomp-idle`, `amqp-idle` and
//! `fleet`, `bindings`, and `connect` (connection setup and TLS handshakes), with
//! hand-written minimal clients on tokio. Every run prints its result as one JSON line on
//! stdout; progress goes to stderr. Arguments: `args.rs` (clap).

mod amqp;
mod args;
mod bindings;
mod connect;
mod delayed;
mod disk;
mod e2e;
mod fleet;
mod idle;
mod mqtt;
mod report;
mod stomp;
mod store_bench;
mod sys;
mod wire;

use std::io::Read;
use std::process::ExitCode;

use args::Command;

fn emit(v: &serde_json::Value, json_only: bool) {
    if !json_only {
        println!("{}", report::human(v));
    }
    println!("{}", report::result_line(v));
}

/// Prints the result; a run whose clients hit errors (connection refused or closed by the
/// broker, ...) still prints its line but fails.
fn emit_checked(v: &serde_json::Value, json_only: bool) -> Result<(), String> {
    emit(v, json_only);
    match v.get("errors").and_then(|e| e.as_array()) {
        Some(e) if !e.is_empty() => Err(format!(
            "{} client error(s), first: {}",
            e.len(),
            e[0].as_str().unwrap_or("?")
        )),
        _ => Ok(()),
    }
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let cmd = match args::parse_clap(&argv) {
        args::Parsed::Run(c) => *c,
        // help and --version on stdout with status 0, errors on stderr with status 2
        args::Parsed::Exit(e) => e.exit(),
    };
    let res = match cmd {
        Command::Connect(a) => connect::run(&a).and_then(|v| emit_checked(&v, a.json)),
        Command::Store(a) => store_bench::run(&a).map(|v| emit(&v, a.json)),
        Command::Disk(a) => disk::run(&a).map(|vs| {
            for v in &vs {
                emit(v, a.json);
            }
        }),
        Command::Amqp(a) => {
            e2e::log_slow(a.load.slow_ms);
            let r = match a.delayed {
                Some(ms) => delayed::run(&a, ms),
                None => amqp::run(&a),
            };
            e2e::report_slow();
            r.and_then(|v| emit_checked(&v, a.load.json))
        }
        Command::Stomp(a) => {
            e2e::log_slow(a.load.slow_ms);
            let r = stomp::run(&a);
            e2e::report_slow();
            r.and_then(|v| emit_checked(&v, a.load.json))
        }
        Command::Mqtt(a) => {
            e2e::log_slow(a.load.slow_ms);
            let r = mqtt::run(&a);
            e2e::report_slow();
            r.and_then(|v| emit_checked(&v, a.load.json))
        }
        Command::Idle(a) => idle::run(&a).and_then(|v| emit_checked(&v, a.json)),
        Command::Fleet(a) => fleet::run(&a).and_then(|v| emit_checked(&v, a.json)),
        Command::Bindings(a) => bindings::run(&a).and_then(|v| emit_checked(&v, a.json)),
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
