//! Hand-rolled argument parsing (`--flag value` or `--flag=value`).

use std::path::PathBuf;
use std::time::Duration;

pub const USAGE: &str = "\
triad-bench: load generator for Triad

USAGE:
  triad-bench store [OPTIONS]   appends through triad-store, one durable wait per append
  triad-bench disk  [OPTIONS]   baselines: dd bandwidth, write+fdatasync loops
  triad-bench table [FILE]      Markdown table from result lines (FILE or stdin)

STORE OPTIONS:
  --dir DIR            parent of the data directory bench-data-<pid> (default .; removed after)
  --size BYTES         message body size, suffixes k/K/KiB, m/M/MiB (default 1024)
  --writers N          writer threads (default 1)
  --queues N           durable queues; writer i appends to queue i % N (default 1)
  --flush sync|async   sync = group commit, async = 200 ms / 16 MiB (default sync)
  --count N            total messages (split evenly over the writers)
  --duration SECS      run time when --count is not given (default 5); with --count, a cap
  --segment-size BYTES commitlog segment size (default 1 GiB)
  --read               then read everything back through read_queue and verify each body
  --keep               keep the data directory
  --allow-tmpfs        run on tmpfs/ramfs (refused by default: we want the real disk)
  --json               print only the final JSON line on stdout
  --quiet              no progress line on stderr

DISK OPTIONS:
  --dir DIR            parent of the scratch directory (default .)
  --size BYTES         write size of the fdatasync loops (default 1024)
  --count N            iterations of each loop (default: --duration)
  --duration SECS      run time of each loop (default 5)
  --dd-mib N           MiB written by dd (default 1024)
  --file-mib N         size of the loops' preallocated file (default 512)
  --test LIST          comma list of dd, overwrite, fallocated (default all three)
  --allow-tmpfs, --json, --quiet as above
";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flush {
    Sync,
    Async,
}

impl Flush {
    pub fn name(self) -> &'static str {
        match self {
            Flush::Sync => "sync",
            Flush::Async => "async",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct StoreArgs {
    pub dir: PathBuf,
    pub size: usize,
    pub writers: usize,
    pub queues: usize,
    pub flush: Flush,
    pub count: Option<u64>,
    pub duration: Option<Duration>,
    pub segment_size: u64,
    pub read: bool,
    pub keep: bool,
    pub allow_tmpfs: bool,
    pub json: bool,
    pub quiet: bool,
}

impl Default for StoreArgs {
    fn default() -> Self {
        StoreArgs {
            dir: PathBuf::from("."),
            size: 1024,
            writers: 1,
            queues: 1,
            flush: Flush::Sync,
            count: None,
            duration: None,
            segment_size: 1 << 30,
            read: false,
            keep: false,
            allow_tmpfs: false,
            json: false,
            quiet: false,
        }
    }
}

impl StoreArgs {
    /// The time cap: `--duration`, or 5 s unless a `--count` bounds the run.
    pub fn time_cap(&self) -> Option<Duration> {
        match (self.count, self.duration) {
            (_, Some(d)) => Some(d),
            (None, None) => Some(Duration::from_secs(5)),
            (Some(_), None) => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskTest {
    Dd,
    Overwrite,
    Fallocated,
}

impl DiskTest {
    pub fn name(self) -> &'static str {
        match self {
            DiskTest::Dd => "dd",
            DiskTest::Overwrite => "overwrite",
            DiskTest::Fallocated => "fallocated",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct DiskArgs {
    pub dir: PathBuf,
    pub size: usize,
    pub count: Option<u64>,
    pub duration: Duration,
    pub dd_mib: u64,
    pub file_mib: u64,
    pub tests: Vec<DiskTest>,
    pub allow_tmpfs: bool,
    pub json: bool,
    pub quiet: bool,
}

impl Default for DiskArgs {
    fn default() -> Self {
        DiskArgs {
            dir: PathBuf::from("."),
            size: 1024,
            count: None,
            duration: Duration::from_secs(5),
            dd_mib: 1024,
            file_mib: 512,
            tests: vec![DiskTest::Dd, DiskTest::Overwrite, DiskTest::Fallocated],
            allow_tmpfs: false,
            json: false,
            quiet: false,
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum Command {
    Store(StoreArgs),
    Disk(DiskArgs),
    Table(Option<PathBuf>),
    Help,
}

/// `64`, `1k`, `1K`, `1KiB`, `64KiB`, `1m`, `1MiB`, `1g`: binary multiples.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        _ => return Err(format!("bad size unit in {s:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

fn parse_num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{flag}: expected a number, got {v:?}"))
}

fn parse_secs(flag: &str, v: &str) -> Result<Duration, String> {
    let f: f64 = parse_num(flag, v)?;
    if !f.is_finite() || f <= 0.0 || f > 86_400.0 {
        return Err(format!("{flag}: expected seconds in (0, 86400], got {v:?}"));
    }
    Ok(Duration::from_secs_f64(f))
}

/// Splits `--flag=value` / `--flag value`; `takes_value` says which flags take one.
struct Flags<'a> {
    args: &'a [String],
    i: usize,
}

impl<'a> Flags<'a> {
    fn next(
        &mut self,
        takes_value: impl Fn(&str) -> bool,
    ) -> Option<Result<(String, String), String>> {
        let a = self.args.get(self.i)?;
        self.i += 1;
        if !a.starts_with("--") {
            return Some(Err(format!("unexpected argument {a:?}")));
        }
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (a.clone(), None),
        };
        if !takes_value(&flag) {
            return Some(match inline {
                Some(_) => Err(format!("{flag} takes no value")),
                None => Ok((flag, String::new())),
            });
        }
        let value = match inline {
            Some(v) => v,
            None => match self.args.get(self.i) {
                Some(v) => {
                    self.i += 1;
                    v.clone()
                }
                None => return Some(Err(format!("{flag} needs a value"))),
            },
        };
        Some(Ok((flag, value)))
    }
}

fn positive(flag: &str, n: u64) -> Result<u64, String> {
    if n == 0 {
        Err(format!("{flag} must be at least 1"))
    } else {
        Ok(n)
    }
}

pub fn parse_store(args: &[String]) -> Result<StoreArgs, String> {
    let mut o = StoreArgs::default();
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        matches!(
            f,
            "--dir"
                | "--size"
                | "--writers"
                | "--queues"
                | "--flush"
                | "--count"
                | "--duration"
                | "--segment-size"
        )
    };
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        match flag.as_str() {
            "--dir" => o.dir = PathBuf::from(v),
            "--size" => {
                o.size = usize::try_from(parse_size(&v)?).map_err(|_| "--size too large")?
            }
            "--writers" => o.writers = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--queues" => o.queues = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--flush" => {
                o.flush = match v.as_str() {
                    "sync" => Flush::Sync,
                    "async" => Flush::Async,
                    _ => return Err(format!("--flush: expected sync or async, got {v:?}")),
                }
            }
            "--count" => o.count = Some(positive(&flag, parse_num(&flag, &v)?)?),
            "--duration" => o.duration = Some(parse_secs(&flag, &v)?),
            "--segment-size" => {
                o.segment_size = parse_size(&v)?;
                if o.segment_size < 4096 {
                    return Err("--segment-size must be at least 4096".into());
                }
            }
            "--read" => o.read = true,
            "--keep" => o.keep = true,
            "--allow-tmpfs" => o.allow_tmpfs = true,
            "--json" => o.json = true,
            "--quiet" => o.quiet = true,
            _ => return Err(format!("unknown option {flag} for `store`")),
        }
    }
    if o.queues > o.writers {
        return Err(format!(
            "--queues {} exceeds --writers {}: some queues would stay empty",
            o.queues, o.writers
        ));
    }
    if (o.size as u64) + 1024 > o.segment_size {
        return Err("--size must fit in a segment (--segment-size)".into());
    }
    Ok(o)
}

pub fn parse_disk(args: &[String]) -> Result<DiskArgs, String> {
    let mut o = DiskArgs::default();
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        matches!(
            f,
            "--dir" | "--size" | "--count" | "--duration" | "--dd-mib" | "--file-mib" | "--test"
        )
    };
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        match flag.as_str() {
            "--dir" => o.dir = PathBuf::from(v),
            "--size" => {
                let s = parse_size(&v)?;
                o.size = usize::try_from(positive(&flag, s)?).map_err(|_| "--size too large")?
            }
            "--count" => o.count = Some(positive(&flag, parse_num(&flag, &v)?)?),
            "--duration" => o.duration = parse_secs(&flag, &v)?,
            "--dd-mib" => o.dd_mib = positive(&flag, parse_num(&flag, &v)?)?,
            "--file-mib" => o.file_mib = positive(&flag, parse_num(&flag, &v)?)?,
            "--test" => {
                o.tests = v
                    .split(',')
                    .map(|t| match t.trim() {
                        "dd" => Ok(DiskTest::Dd),
                        "overwrite" => Ok(DiskTest::Overwrite),
                        "fallocated" => Ok(DiskTest::Fallocated),
                        other => Err(format!("--test: unknown test {other:?}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--allow-tmpfs" => o.allow_tmpfs = true,
            "--json" => o.json = true,
            "--quiet" => o.quiet = true,
            _ => return Err(format!("unknown option {flag} for `disk`")),
        }
    }
    if (o.size as u64) > o.file_mib << 20 {
        return Err("--size exceeds --file-mib".into());
    }
    Ok(o)
}

pub fn parse(args: &[String]) -> Result<Command, String> {
    let Some((cmd, rest)) = args.split_first() else {
        return Ok(Command::Help);
    };
    if rest.iter().any(|a| a == "-h" || a == "--help") {
        return Ok(Command::Help);
    }
    match cmd.as_str() {
        "store" => parse_store(rest).map(Command::Store),
        "disk" => parse_disk(rest).map(Command::Disk),
        "table" => match rest {
            [] => Ok(Command::Table(None)),
            [f] if !f.starts_with('-') => Ok(Command::Table(Some(PathBuf::from(f)))),
            _ => Err("usage: triad-bench table [FILE]".into()),
        },
        "-h" | "--help" | "help" => Ok(Command::Help),
        other => Err(format!("unknown command {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16"), Ok(16));
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("1x").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn store_defaults() {
        let Command::Store(a) = parse(&v("store")).unwrap() else {
            panic!()
        };
        assert_eq!(a, StoreArgs::default());
        assert_eq!(a.time_cap(), Some(Duration::from_secs(5)));
    }

    #[test]
    fn store_all_options() {
        let a = parse_store(&v(
            "--dir /data --size=64k --writers 64 --queues 8 --flush async --count 1000 \
             --segment-size 64M --read --keep --json --quiet --allow-tmpfs",
        ))
        .unwrap();
        assert_eq!(a.dir, PathBuf::from("/data"));
        assert_eq!(a.size, 65536);
        assert_eq!((a.writers, a.queues), (64, 8));
        assert_eq!(a.flush, Flush::Async);
        assert_eq!(a.count, Some(1000));
        assert_eq!(a.time_cap(), None);
        assert_eq!(a.segment_size, 64 << 20);
        assert!(a.read && a.keep && a.json && a.quiet && a.allow_tmpfs);
        let b = parse_store(&v("--count 10 --duration 0.5")).unwrap();
        assert_eq!(b.time_cap(), Some(Duration::from_millis(500)));
    }

    #[test]
    fn store_errors() {
        for bad in [
            "--flush maybe",
            "--writers 0",
            "--writers",
            "--size 1q",
            "--duration 0",
            "--duration -1",
            "--bogus",
            "positional",
            "--json=yes",
            "--writers 2 --queues 3",
            "--segment-size 4k --size 4k",
        ] {
            assert!(parse_store(&v(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn disk_and_table() {
        let Command::Disk(d) = parse(&v(
            "disk --size 16 --count 100 --test dd,fallocated --dd-mib 8",
        ))
        .unwrap() else {
            panic!()
        };
        assert_eq!(d.size, 16);
        assert_eq!(d.count, Some(100));
        assert_eq!(d.dd_mib, 8);
        assert_eq!(d.tests, vec![DiskTest::Dd, DiskTest::Fallocated]);
        assert!(parse(&v("disk --test nope")).is_err());
        assert!(parse(&v("disk --size 0")).is_err());
        assert_eq!(parse(&v("table")), Ok(Command::Table(None)));
        assert_eq!(
            parse(&v("table r.jsonl")),
            Ok(Command::Table(Some(PathBuf::from("r.jsonl"))))
        );
        assert_eq!(parse(&[]), Ok(Command::Help));
        assert_eq!(parse(&v("store --help")), Ok(Command::Help));
        assert!(parse(&v("frobnicate")).is_err());
    }
}
