//! Hand-rolled argument parsing (`--flag value` or `--flag=value`).

use std::path::PathBuf;
use std::time::Duration;

pub const USAGE: &str = "\
triad-bench: load generator for Triad

USAGE:
  triad-bench store [OPTIONS]   appends through triad-store, one durable wait per append
  triad-bench disk  [OPTIONS]   baselines: dd bandwidth, write+fdatasync loops
  triad-bench table [FILE]      Markdown table from result lines (FILE or stdin)
  triad-bench amqp  [OPTIONS]   AMQP 0-9-1 producers and consumers (like RabbitMQ PerfTest)
  triad-bench stomp [OPTIONS]   STOMP 1.2 producers and consumers on /queue/<name>
  triad-bench mqtt  [OPTIONS]   MQTT 3.1.1 publishers and subscribers (like emqtt-bench)
  triad-bench mqtt-idle [OPTIONS]  N idle MQTT connections held open; broker RSS per connection
  triad-bench fleet [OPTIONS]   N persistent MQTT sessions: create rate per block, disk and
                                RSS per session, restart time
  triad-bench bindings [OPTIONS] durable queues and topic bindings: RssAnon per binding,
                                restart time, routing cost at that size
  triad-bench stomp-idle [OPTIONS] the same for STOMP (CONNECT, heart-beat 0,0)
  triad-bench amqp-idle [OPTIONS]  the same for AMQP (handshake and one open channel)

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
  --consume            ack each message once durable (a consumer that keeps up); with
                       retention every second, reports the log's size on disk
  --slow-every N       with --consume: every Nth message also goes to one slow queue
                       nobody consumes, which commitlog compaction must not let pin the log
  --small-queue-entries N  store: queues holding at most N entries use the shared index
                       (default 64); 0 = every queue has its own consume-queue files
  --cq-entries-per-file N  store: entries per consume-queue file (default 300000)
  --fleet N            instead of writers: the consume-queue layer alone, N queues with
                       --per-queue entries each, then one busy queue of --busy entries;
                       reports time, CPU, RssAnon, disk, mappings and fds per queue
  --per-queue M        entries per fleet queue (default 1)
  --busy N             entries of the fleet mode's busy queue (default 1000000)
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

BROKER OPTIONS (amqp, stomp, mqtt):
  --host HOST          broker address (default 127.0.0.1; loopback only)
  --port PORT          default 5672 (amqp), 61613 (stomp), 1883 (mqtt)
  --producers N        producer connections (mqtt: also --publishers; default 1)
  --consumers N        consumer connections (mqtt: also --subscribers; default 1)
  --size BYTES         body size, at least 16 (default 1024)
  --count N            messages published in all (split over the producers)
  --duration SECS      publishing time when --count is not given (default 5); with --count, a cap
  --rate R             total publish rate, msgs/s (default: as fast as possible)
  --drain-timeout SECS after publishing, give up when nothing arrives for this long (default 5)
  --broker-pid PID     report the broker's CPU time per message and RSS (from /proc/PID)
  --threads N          client runtime threads (default 2)
  --user U --pass P    credentials (default guest/guest)
  --json, --quiet      only the JSON line on stdout; no progress line on stderr
  --slow-ms MS         after the run, list on stderr each 5 ms window of send times that
                       had messages slower than MS (count, max latency, producers), with
                       the run's clock origin in CLOCK_MONOTONIC ns (for `perf -k mono`)
Every consumer checks every body (producer id, sequence number, send time) and the result
counts lost, duplicated, out-of-order, unexpected and corrupt messages.

AMQP OPTIONS:
  --queues N           queues; producer i publishes to queue i % N, consumer j reads queue j % N
  --fanout N           N queues bound to one fanout exchange instead (every message to each)
  --persistent         durable queues, delivery-mode 2
  --confirm            publisher confirms, at most --confirm-window (default 1000) unconfirmed
  --manual-ack         consumers ack (multiple); default no-ack
  --prefetch N         basic.qos prefetch-count (with --manual-ack; default none)
  --vhost V            default /

STOMP OPTIONS:
  --queues N           as for amqp, destinations /queue/<name>
  --persistent         persistent:true on SEND
  --receipts           a receipt on every SEND, at most --receipt-window (default 1000) pending
  --ack auto|client|client-individual   (default auto; client acks cumulatively)
  --prefetch N         prefetch-count header on SUBSCRIBE
  --vhost V            host header of CONNECT (default /)

MQTT OPTIONS:
  --qos 0|1|2          publish and subscribe QoS (default 0)
  --topic T            topic prefix (default triad-bench/<pid>)
  --topics N           publisher i publishes to T/(i % N), subscriber j subscribes to
                       T/(j % N) (default 1: every subscriber gets every message)
  --inflight N         unacknowledged QoS 1/2 publishes per publisher (default 100)

MQTT-IDLE, STOMP-IDLE, AMQP-IDLE OPTIONS:
  --host, --port, --broker-pid, --user, --pass, --json, --quiet as above
  --connections N      idle clients to connect (default 1000, at most 100000)
  --hold SECS          how long to hold them once all are connected (default 5)
  --parallel N         connects in flight at once (default 200)
  --tls                over TLS (the server certificate is not verified; give the TLS port)
  --sources K          connect from 127.0.0.1 ..= 127.0.0.K in turn (default 1), so that
                       many connections do not run out of ephemeral ports

FLEET OPTIONS (device n: client id dev-<n>, clean session 0, SUBSCRIBE dev/<n>/cmd QoS 1):
  the broker, one of:
  --triad BIN          start BIN on a fresh data directory under --dir (ephemeral ports)
  --mosquitto BIN      start Mosquitto (persistence true) on a fresh directory under --dir
  --port PORT [--host HOST] [--broker-pid PID] [--data-dir DIR]
                       a broker already running; CPU and RSS need the pid, disk the data
                       directory; the restart is not measured
  --name NAME          label in the result (default triad, mosquitto, or \"broker\")
  --sessions N         persistent sessions to create (default 1000, at most 1000000)
  --block N            sessions per rate block (default 1000)
  --parallel N         sessions being created at once (default 50)
  --idle-connections N sessions reconnected and held open for RSS per connection
                       (default 19000; 0 skips)
  --hold SECS          how long they are held before RSS is read (default 2)
  --publish N          queue a message for the first N sessions only (default: all)
  --sources N          source addresses 127.0.0.1..127.0.0.N (default 16)
  --time-limit SECS    cap on each phase (default 600); a phase cut short says so
  --no-restart         do not stop and restart the broker started here
  --dir DIR, --keep, --allow-tmpfs   where the data directory goes (default .)
  --user, --pass, --threads, --json, --quiet as above (default: no user name)

BINDINGS OPTIONS (session n: persistent MQTT client dev-<n> subscribed at QoS 1 to
dev/<n>/cmd and dev/<n>/f<j>/+/x in one SUBSCRIBE; create, restart, then route):
  --triad BIN          start BIN on a fresh data directory under --dir (required)
  --queues N           sessions, i.e. durable queues (default 1000)
  --bindings N         subscriptions in all, spread evenly over the sessions (default 10000)
  --parallel N         sessions being created at once (default 64)
  --window N           unconfirmed publishes in the route phase (default 500)
  --publish N          mandatory transient AMQP messages to amq.topic after the restart,
                       each matching one binding (default 200000; 0 skips)
  --time-limit SECS    cap on each phase (default 1800)
  --dir DIR, --keep, --allow-tmpfs, --threads, --json, --quiet as above
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
    pub small_queue_entries: Option<u64>,
    pub cq_entries_per_file: Option<u64>,
    pub fleet: Option<u64>,
    pub per_queue: u64,
    pub busy: u64,
    /// Ack each message once it is durable (a consumer keeping up).
    pub consume: bool,
    /// Every Nth message of each writer also goes to one slow queue nobody consumes.
    pub slow_every: Option<u64>,
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
            small_queue_entries: None,
            cq_entries_per_file: None,
            fleet: None,
            per_queue: 1,
            busy: 1_000_000,
            consume: false,
            slow_every: None,
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

/// Options every broker benchmark takes.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadArgs {
    pub host: String,
    pub port: u16,
    pub producers: usize,
    pub consumers: usize,
    pub size: usize,
    pub count: Option<u64>,
    pub duration: Option<Duration>,
    pub rate: Option<f64>,
    pub drain_timeout: Duration,
    pub broker_pid: Option<u32>,
    pub threads: usize,
    pub user: String,
    pub pass: String,
    pub json: bool,
    pub quiet: bool,
    pub slow_ms: Option<u64>,
}

impl LoadArgs {
    fn new(port: u16) -> LoadArgs {
        LoadArgs {
            host: "127.0.0.1".into(),
            port,
            producers: 1,
            consumers: 1,
            size: 1024,
            count: None,
            duration: None,
            rate: None,
            drain_timeout: Duration::from_secs(5),
            broker_pid: None,
            threads: 2,
            user: "guest".into(),
            pass: "guest".into(),
            json: false,
            quiet: false,
            slow_ms: None,
        }
    }

    /// The publishing time cap: `--duration`, or 5 s unless a `--count` bounds the run.
    pub fn time_cap(&self) -> Option<Duration> {
        match (self.count, self.duration) {
            (_, Some(d)) => Some(d),
            (None, None) => Some(Duration::from_secs(5)),
            (Some(_), None) => None,
        }
    }

    fn flag(&mut self, flag: &str, v: &str) -> Result<bool, String> {
        match flag {
            "--host" => self.host = v.to_string(),
            "--port" => self.port = parse_num(flag, v)?,
            "--producers" | "--publishers" => {
                self.producers = positive(flag, parse_num(flag, v)?)? as usize
            }
            "--consumers" | "--subscribers" => self.consumers = parse_num(flag, v)?,
            "--size" => {
                self.size = usize::try_from(parse_size(v)?).map_err(|_| "--size too large")?;
                if self.size < crate::e2e::STAMP || self.size > 64 << 20 {
                    return Err(format!(
                        "--size must be in [{}, 64 MiB]: bodies carry a {}-byte stamp",
                        crate::e2e::STAMP,
                        crate::e2e::STAMP
                    ));
                }
            }
            "--count" => {
                let c = positive(flag, parse_num(flag, v)?)?;
                if c > u64::from(u32::MAX) {
                    return Err("--count: at most 2^32 - 1".into());
                }
                self.count = Some(c)
            }
            "--duration" => self.duration = Some(parse_secs(flag, v)?),
            "--rate" => {
                let r: f64 = parse_num(flag, v)?;
                if !r.is_finite() || r <= 0.0 {
                    return Err(format!("--rate: expected a positive rate, got {v:?}"));
                }
                self.rate = Some(r)
            }
            "--drain-timeout" => self.drain_timeout = parse_secs(flag, v)?,
            "--broker-pid" => self.broker_pid = Some(positive(flag, parse_num(flag, v)?)? as u32),
            "--threads" => self.threads = positive(flag, parse_num(flag, v)?)? as usize,
            "--user" => self.user = v.to_string(),
            "--pass" => self.pass = v.to_string(),
            "--json" => self.json = true,
            "--quiet" => self.quiet = true,
            "--slow-ms" => self.slow_ms = Some(positive(flag, parse_num(flag, v)?)?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

const LOAD_VALUED: &[&str] = &[
    "--host",
    "--port",
    "--producers",
    "--publishers",
    "--consumers",
    "--subscribers",
    "--size",
    "--count",
    "--duration",
    "--rate",
    "--drain-timeout",
    "--broker-pid",
    "--threads",
    "--user",
    "--pass",
    "--slow-ms",
];

#[derive(Clone, Debug, PartialEq)]
pub struct AmqpArgs {
    pub load: LoadArgs,
    pub queues: usize,
    pub fanout: Option<usize>,
    pub persistent: bool,
    pub confirm: bool,
    pub confirm_window: usize,
    pub manual_ack: bool,
    pub prefetch: u16,
    pub vhost: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StompAck {
    Auto,
    Client,
    ClientIndividual,
}

impl StompAck {
    pub fn name(self) -> &'static str {
        match self {
            StompAck::Auto => "auto",
            StompAck::Client => "client",
            StompAck::ClientIndividual => "client-individual",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct StompArgs {
    pub load: LoadArgs,
    pub queues: usize,
    pub persistent: bool,
    pub receipts: bool,
    pub receipt_window: usize,
    pub ack: StompAck,
    pub prefetch: Option<u32>,
    pub vhost: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MqttArgs {
    pub load: LoadArgs,
    pub qos: u8,
    pub topic: String,
    pub topics: usize,
    pub inflight: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleProto {
    Mqtt,
    Stomp,
    Amqp,
}

impl IdleProto {
    pub fn name(self) -> &'static str {
        match self {
            IdleProto::Mqtt => "mqtt",
            IdleProto::Stomp => "stomp",
            IdleProto::Amqp => "amqp",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct IdleArgs {
    pub proto: IdleProto,
    pub tls: bool,
    pub sources: u8,
    pub host: String,
    pub port: u16,
    pub connections: usize,
    pub hold: Duration,
    pub parallel: usize,
    pub broker_pid: Option<u32>,
    pub user: Option<String>,
    pub pass: Option<String>,
    pub json: bool,
    pub quiet: bool,
}

/// Which broker `fleet` runs against.
#[derive(Clone, Debug, PartialEq)]
pub enum FleetTarget {
    /// Started by the bench from this binary.
    Triad(PathBuf),
    /// Mosquitto, started by the bench from this binary with persistence on.
    Mosquitto(PathBuf),
    /// Already running.
    Running {
        host: String,
        port: u16,
        pid: Option<u32>,
        data_dir: Option<PathBuf>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct FleetArgs {
    pub target: FleetTarget,
    pub name: Option<String>,
    pub sessions: usize,
    pub block: usize,
    pub parallel: usize,
    pub idle_connections: usize,
    pub hold: Duration,
    pub publish: Option<usize>,
    pub sources: u8,
    pub time_limit: Duration,
    pub restart: bool,
    pub dir: PathBuf,
    pub keep: bool,
    pub allow_tmpfs: bool,
    pub user: Option<String>,
    pub pass: Option<String>,
    pub threads: usize,
    pub json: bool,
    pub quiet: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BindingsArgs {
    pub triad: PathBuf,
    pub queues: usize,
    pub bindings: usize,
    pub parallel: usize,
    pub window: usize,
    pub publish: usize,
    pub time_limit: Duration,
    pub dir: PathBuf,
    pub keep: bool,
    pub allow_tmpfs: bool,
    pub threads: usize,
    pub json: bool,
    pub quiet: bool,
}

#[derive(Debug, PartialEq)]
pub enum Command {
    Bindings(BindingsArgs),
    Store(StoreArgs),
    Disk(DiskArgs),
    Amqp(AmqpArgs),
    Stomp(StompArgs),
    Mqtt(MqttArgs),
    Idle(IdleArgs),
    Fleet(FleetArgs),
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
                | "--small-queue-entries"
                | "--cq-entries-per-file"
                | "--fleet"
                | "--per-queue"
                | "--busy"
                | "--slow-every"
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
            "--small-queue-entries" => {
                let n = parse_num(&flag, &v)?;
                if n != 0 && n < 8 {
                    return Err("--small-queue-entries must be 0 or at least 8".into());
                }
                o.small_queue_entries = Some(n);
            }
            "--cq-entries-per-file" => {
                o.cq_entries_per_file = Some(positive(&flag, parse_num(&flag, &v)?)?)
            }
            "--fleet" => o.fleet = Some(positive(&flag, parse_num(&flag, &v)?)?),
            "--per-queue" => o.per_queue = positive(&flag, parse_num(&flag, &v)?)?,
            "--busy" => o.busy = parse_num(&flag, &v)?,
            "--read" => o.read = true,
            "--consume" => o.consume = true,
            "--slow-every" => o.slow_every = Some(positive(&flag, parse_num(&flag, &v)?)?),
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
    if o.consume && o.read {
        return Err("--read verifies what is kept; --consume acks it all".into());
    }
    if o.slow_every.is_some() && !o.consume {
        return Err("--slow-every needs --consume".into());
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

fn loopback(host: &str) -> Result<(), String> {
    let ok = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "--host {host:?}: only loopback addresses are allowed"
        ))
    }
}

fn check_load(o: &LoadArgs) -> Result<(), String> {
    loopback(&o.host)?;
    if let Some(c) = o.count {
        if c < o.producers as u64 {
            return Err("--count is smaller than --producers".into());
        }
    }
    Ok(())
}

pub fn parse_amqp(args: &[String]) -> Result<AmqpArgs, String> {
    let mut o = AmqpArgs {
        load: LoadArgs::new(5672),
        queues: 1,
        fanout: None,
        persistent: false,
        confirm: false,
        confirm_window: 1000,
        manual_ack: false,
        prefetch: 0,
        vhost: "/".into(),
    };
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        LOAD_VALUED.contains(&f)
            || matches!(
                f,
                "--queues" | "--fanout" | "--confirm-window" | "--prefetch" | "--vhost"
            )
    };
    let mut consumers_given = false;
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        consumers_given |= flag == "--consumers";
        if o.load.flag(&flag, &v)? {
            continue;
        }
        match flag.as_str() {
            "--queues" => o.queues = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--fanout" => o.fanout = Some(positive(&flag, parse_num(&flag, &v)?)? as usize),
            "--persistent" => o.persistent = true,
            "--confirm" => o.confirm = true,
            "--confirm-window" => {
                o.confirm_window = positive(&flag, parse_num(&flag, &v)?)? as usize
            }
            "--manual-ack" => o.manual_ack = true,
            "--prefetch" => o.prefetch = parse_num(&flag, &v)?,
            "--vhost" => o.vhost = v,
            _ => return Err(format!("unknown option {flag} for `amqp`")),
        }
    }
    check_load(&o.load)?;
    let groups = o.fanout.unwrap_or(o.queues);
    if o.fanout.is_some() && !consumers_given {
        o.load.consumers = groups;
    }
    if o.load.consumers < groups {
        return Err(format!(
            "--consumers {} < {groups} queues: some queues would have no consumer",
            o.load.consumers
        ));
    }
    if o.fanout.is_none() && o.queues > o.load.producers {
        return Err("--queues exceeds --producers: some queues would stay empty".into());
    }
    if o.prefetch > 0 && !o.manual_ack {
        return Err("--prefetch needs --manual-ack".into());
    }
    Ok(o)
}

pub fn parse_stomp(args: &[String]) -> Result<StompArgs, String> {
    let mut o = StompArgs {
        load: LoadArgs::new(61613),
        queues: 1,
        persistent: false,
        receipts: false,
        receipt_window: 1000,
        ack: StompAck::Auto,
        prefetch: None,
        vhost: "/".into(),
    };
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        LOAD_VALUED.contains(&f)
            || matches!(
                f,
                "--queues" | "--receipt-window" | "--ack" | "--prefetch" | "--vhost"
            )
    };
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        if o.load.flag(&flag, &v)? {
            continue;
        }
        match flag.as_str() {
            "--queues" => o.queues = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--persistent" => o.persistent = true,
            "--receipts" => o.receipts = true,
            "--receipt-window" => {
                o.receipt_window = positive(&flag, parse_num(&flag, &v)?)? as usize
            }
            "--ack" => {
                o.ack = match v.as_str() {
                    "auto" => StompAck::Auto,
                    "client" => StompAck::Client,
                    "client-individual" => StompAck::ClientIndividual,
                    _ => {
                        return Err(format!(
                            "--ack: expected auto, client or client-individual, got {v:?}"
                        ))
                    }
                }
            }
            "--prefetch" => o.prefetch = Some(positive(&flag, parse_num(&flag, &v)?)? as u32),
            "--vhost" => o.vhost = v,
            _ => return Err(format!("unknown option {flag} for `stomp`")),
        }
    }
    check_load(&o.load)?;
    if o.load.consumers < o.queues {
        return Err("--consumers < --queues: some queues would have no consumer".into());
    }
    if o.queues > o.load.producers {
        return Err("--queues exceeds --producers: some queues would stay empty".into());
    }
    Ok(o)
}

pub fn parse_mqtt(args: &[String]) -> Result<MqttArgs, String> {
    let mut o = MqttArgs {
        load: LoadArgs::new(1883),
        qos: 0,
        topic: format!("triad-bench/{}", std::process::id()),
        topics: 1,
        inflight: 100,
    };
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        LOAD_VALUED.contains(&f) || matches!(f, "--qos" | "--topic" | "--topics" | "--inflight")
    };
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        if o.load.flag(&flag, &v)? {
            continue;
        }
        match flag.as_str() {
            "--qos" => {
                o.qos = match v.as_str() {
                    "0" => 0,
                    "1" => 1,
                    "2" => 2,
                    _ => return Err(format!("--qos: expected 0, 1 or 2, got {v:?}")),
                }
            }
            "--topic" => {
                if v.is_empty() || v.contains(['+', '#', '\0']) {
                    return Err(format!("--topic {v:?}: no wildcards"));
                }
                o.topic = v
            }
            "--topics" => o.topics = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--inflight" => {
                let n: usize = positive(&flag, parse_num(&flag, &v)?)? as usize;
                if n > 65535 {
                    return Err("--inflight: at most 65535".into());
                }
                o.inflight = n
            }
            _ => return Err(format!("unknown option {flag} for `mqtt`")),
        }
    }
    check_load(&o.load)?;
    if o.load.consumers == 0 {
        return Err("--subscribers must be at least 1".into());
    }
    if o.topics > o.load.producers || o.topics > o.load.consumers {
        return Err("--topics exceeds --publishers or --subscribers".into());
    }
    Ok(o)
}

pub fn parse_idle(proto: IdleProto, args: &[String]) -> Result<IdleArgs, String> {
    let mut o = IdleArgs {
        proto,
        tls: false,
        sources: 1,
        host: "127.0.0.1".into(),
        port: match proto {
            IdleProto::Mqtt => 1883,
            IdleProto::Stomp => 61613,
            IdleProto::Amqp => 5672,
        },
        connections: 1000,
        hold: Duration::from_secs(5),
        parallel: 200,
        broker_pid: None,
        user: None,
        pass: None,
        json: false,
        quiet: false,
    };
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        matches!(
            f,
            "--host"
                | "--port"
                | "--connections"
                | "--hold"
                | "--parallel"
                | "--broker-pid"
                | "--user"
                | "--pass"
                | "--sources"
        )
    };
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        match flag.as_str() {
            "--host" => o.host = v,
            "--port" => o.port = parse_num(&flag, &v)?,
            "--tls" => o.tls = true,
            "--sources" => {
                o.sources = parse_num(&flag, &v)?;
                if o.sources == 0 || o.sources > 254 {
                    return Err("--sources: 1 to 254".into());
                }
            }
            "--connections" => {
                o.connections = positive(&flag, parse_num(&flag, &v)?)? as usize;
                if o.connections > 100_000 {
                    return Err("--connections: at most 100000".into());
                }
            }
            "--hold" => o.hold = parse_secs(&flag, &v)?,
            "--parallel" => o.parallel = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--broker-pid" => o.broker_pid = Some(positive(&flag, parse_num(&flag, &v)?)? as u32),
            "--user" => o.user = Some(v),
            "--pass" => o.pass = Some(v),
            "--json" => o.json = true,
            "--quiet" => o.quiet = true,
            _ => return Err(format!("unknown option {flag} for `{}-idle`", proto.name())),
        }
    }
    loopback(&o.host)?;
    Ok(o)
}

pub fn parse_fleet(args: &[String]) -> Result<FleetArgs, String> {
    let mut o = FleetArgs {
        target: FleetTarget::Running {
            host: "127.0.0.1".into(),
            port: 0,
            pid: None,
            data_dir: None,
        },
        name: None,
        sessions: 1000,
        block: 1000,
        parallel: 50,
        idle_connections: 19_000,
        hold: Duration::from_secs(2),
        publish: None,
        sources: 16,
        time_limit: Duration::from_secs(600),
        restart: true,
        dir: PathBuf::from("."),
        keep: false,
        allow_tmpfs: false,
        user: None,
        pass: None,
        threads: 2,
        json: false,
        quiet: false,
    };
    let (mut triad, mut mosquitto) = (None, None);
    let (mut host, mut port, mut pid, mut data_dir) = (None, None, None, None);
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        matches!(
            f,
            "--triad"
                | "--mosquitto"
                | "--host"
                | "--port"
                | "--broker-pid"
                | "--data-dir"
                | "--name"
                | "--sessions"
                | "--block"
                | "--parallel"
                | "--idle-connections"
                | "--hold"
                | "--publish"
                | "--sources"
                | "--time-limit"
                | "--dir"
                | "--user"
                | "--pass"
                | "--threads"
        )
    };
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        match flag.as_str() {
            "--triad" => triad = Some(PathBuf::from(v)),
            "--mosquitto" => mosquitto = Some(PathBuf::from(v)),
            "--host" => host = Some(v),
            "--port" => {
                let p: u16 = parse_num(&flag, &v)?;
                port = Some(positive(&flag, u64::from(p))? as u16)
            }
            "--broker-pid" => pid = Some(positive(&flag, parse_num(&flag, &v)?)? as u32),
            "--data-dir" => data_dir = Some(PathBuf::from(v)),
            "--name" => o.name = Some(v),
            "--sessions" => {
                o.sessions = positive(&flag, parse_num(&flag, &v)?)? as usize;
                if o.sessions > 1_000_000 {
                    return Err("--sessions: at most 1000000".into());
                }
            }
            "--block" => o.block = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--parallel" => o.parallel = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--idle-connections" => o.idle_connections = parse_num(&flag, &v)?,
            "--hold" => o.hold = parse_secs(&flag, &v)?,
            "--publish" => o.publish = Some(parse_num(&flag, &v)?),
            "--sources" => {
                let n: u64 = positive(&flag, parse_num(&flag, &v)?)?;
                o.sources = u8::try_from(n)
                    .ok()
                    .filter(|n| *n <= 254)
                    .ok_or("--sources: at most 254")?;
            }
            "--time-limit" => o.time_limit = parse_secs(&flag, &v)?,
            "--no-restart" => o.restart = false,
            "--dir" => o.dir = PathBuf::from(v),
            "--keep" => o.keep = true,
            "--allow-tmpfs" => o.allow_tmpfs = true,
            "--user" => o.user = Some(v),
            "--pass" => o.pass = Some(v),
            "--threads" => o.threads = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--json" => o.json = true,
            "--quiet" => o.quiet = true,
            _ => return Err(format!("unknown option {flag} for `fleet`")),
        }
    }
    let running = host.is_some() || port.is_some() || pid.is_some() || data_dir.is_some();
    o.target = match (triad, mosquitto, running) {
        (Some(b), None, false) => FleetTarget::Triad(b),
        (None, Some(b), false) => FleetTarget::Mosquitto(b),
        (None, None, true) => {
            let host = host.unwrap_or_else(|| "127.0.0.1".into());
            loopback(&host)?;
            FleetTarget::Running {
                host,
                port: port.ok_or("--port is needed for a running broker")?,
                pid,
                data_dir,
            }
        }
        (None, None, false) => {
            return Err("fleet: give --triad BIN, --mosquitto BIN or --port PORT".into())
        }
        _ => {
            return Err(
                "fleet: --triad, --mosquitto and --host/--port/--broker-pid/--data-dir exclude each other"
                    .into(),
            )
        }
    };
    if o.block > o.sessions {
        return Err("--block exceeds --sessions: no block would complete".into());
    }
    Ok(o)
}

pub fn parse_bindings(args: &[String]) -> Result<BindingsArgs, String> {
    let mut o = BindingsArgs {
        triad: PathBuf::new(),
        queues: 1000,
        bindings: 10_000,
        parallel: 64,
        window: 500,
        publish: 200_000,
        time_limit: Duration::from_secs(1800),
        dir: PathBuf::from("."),
        keep: false,
        allow_tmpfs: false,
        threads: 2,
        json: false,
        quiet: false,
    };
    let mut triad = None;
    let mut f = Flags { args, i: 0 };
    let valued = |f: &str| {
        matches!(
            f,
            "--triad"
                | "--queues"
                | "--bindings"
                | "--parallel"
                | "--window"
                | "--publish"
                | "--time-limit"
                | "--dir"
                | "--threads"
        )
    };
    while let Some(r) = f.next(valued) {
        let (flag, v) = r?;
        match flag.as_str() {
            "--triad" => triad = Some(PathBuf::from(v)),
            "--queues" => o.queues = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--bindings" => o.bindings = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--parallel" => o.parallel = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--window" => o.window = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--publish" => o.publish = parse_num(&flag, &v)?,
            "--time-limit" => o.time_limit = parse_secs(&flag, &v)?,
            "--dir" => o.dir = PathBuf::from(v),
            "--keep" => o.keep = true,
            "--allow-tmpfs" => o.allow_tmpfs = true,
            "--threads" => o.threads = positive(&flag, parse_num(&flag, &v)?)? as usize,
            "--json" => o.json = true,
            "--quiet" => o.quiet = true,
            _ => return Err(format!("unknown option {flag} for `bindings`")),
        }
    }
    o.triad = triad.ok_or("bindings: --triad BIN is needed (the bench restarts the broker)")?;
    if o.queues > 10_000_000 || o.bindings > 100_000_000 {
        return Err("bindings: at most 10000000 queues and 100000000 bindings".into());
    }
    if o.bindings < o.queues {
        return Err("bindings: --bindings must be at least --queues (one per queue)".into());
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
        "amqp" => parse_amqp(rest).map(Command::Amqp),
        "stomp" => parse_stomp(rest).map(Command::Stomp),
        "mqtt" => parse_mqtt(rest).map(Command::Mqtt),
        "mqtt-idle" => parse_idle(IdleProto::Mqtt, rest).map(Command::Idle),
        "stomp-idle" => parse_idle(IdleProto::Stomp, rest).map(Command::Idle),
        "amqp-idle" => parse_idle(IdleProto::Amqp, rest).map(Command::Idle),
        "fleet" => parse_fleet(rest).map(Command::Fleet),
        "bindings" => parse_bindings(rest).map(Command::Bindings),
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
    fn bindings_args() {
        let Command::Bindings(b) = parse(&v(
            "bindings --triad target/release/triad --queues 100000 --bindings 1000000 --json",
        ))
        .unwrap() else {
            panic!("not bindings")
        };
        assert_eq!((b.queues, b.bindings, b.parallel), (100_000, 1_000_000, 64));
        assert!(b.json && !b.keep);
        assert!(parse(&v("bindings --queues 10")).is_err(), "no --triad");
        assert!(parse(&v("bindings --triad t --queues 10 --bindings 5")).is_err());
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
        let c = parse_store(&v(
            "--fleet 100000 --per-queue 2 --busy 10 --small-queue-entries 0 \
             --cq-entries-per-file 1024",
        ))
        .unwrap();
        assert_eq!((c.fleet, c.per_queue, c.busy), (Some(100_000), 2, 10));
        assert_eq!(
            (c.small_queue_entries, c.cq_entries_per_file),
            (Some(0), Some(1024))
        );
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
            "--small-queue-entries 4",
            "--fleet 0",
            "--per-queue 0",
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

    #[test]
    fn amqp_options() {
        let Command::Amqp(a) = parse(&v(
            "amqp --port 5680 --producers 4 --consumers 4 --queues 2 \
             --size 1k --count 1000 --persistent --confirm --confirm-window 50 --manual-ack \
             --prefetch 100 --user u --pass p --broker-pid 42 --rate 500 --json --quiet \
             --slow-ms 20",
        ))
        .unwrap() else {
            panic!()
        };
        assert_eq!((a.load.host.as_str(), a.load.port), ("127.0.0.1", 5680));
        assert_eq!((a.load.producers, a.load.consumers, a.queues), (4, 4, 2));
        assert_eq!((a.load.size, a.load.count), (1024, Some(1000)));
        assert!(a.persistent && a.confirm && a.manual_ack && a.load.json && a.load.quiet);
        assert_eq!((a.confirm_window, a.prefetch), (50, 100));
        assert_eq!((a.load.user.as_str(), a.load.pass.as_str()), ("u", "p"));
        assert_eq!((a.load.broker_pid, a.load.rate), (Some(42), Some(500.0)));
        assert_eq!(a.load.time_cap(), None);
        assert_eq!(a.load.slow_ms, Some(20));
        let d = parse_amqp(&v("--fanout 10")).unwrap();
        assert_eq!(d.load.slow_ms, None);
        assert_eq!(
            (d.fanout, d.load.consumers, d.load.port),
            (Some(10), 10, 5672)
        );
        assert_eq!(d.load.time_cap(), Some(Duration::from_secs(5)));
        for bad in [
            "--host 10.0.0.1",
            "--host example.com",
            "--size 15",
            "--fanout 4 --consumers 2",
            "--queues 2",
            "--prefetch 10",
            "--count 1 --producers 2",
            "--rate 0",
            "--port 70000",
            "--qos 1",
            "--slow-ms 0",
        ] {
            assert!(parse_amqp(&v(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn stomp_and_mqtt_options() {
        let s = parse_stomp(&v(
            "--port 61620 --ack client-individual --receipts --receipt-window 10 --prefetch 5 --persistent",
        ))
        .unwrap();
        assert_eq!(s.ack, StompAck::ClientIndividual);
        assert!(s.receipts && s.persistent);
        assert_eq!(
            (s.receipt_window, s.prefetch, s.load.port),
            (10, Some(5), 61620)
        );
        assert!(parse_stomp(&v("--ack sometimes")).is_err());
        assert!(parse_stomp(&v("--consumers 0")).is_err());

        let m = parse_mqtt(&v(
            "--publishers 4 --subscribers 8 --topics 4 --qos 2 --topic t/x --inflight 10 --size 64",
        ))
        .unwrap();
        assert_eq!((m.load.producers, m.load.consumers, m.topics), (4, 8, 4));
        assert_eq!(
            (m.qos, m.topic.as_str(), m.inflight, m.load.size),
            (2, "t/x", 10, 64)
        );
        for bad in [
            "--qos 3",
            "--topic a/+",
            "--topics 2",
            "--inflight 70000",
            "--subscribers 0",
        ] {
            assert!(parse_mqtt(&v(bad)).is_err(), "{bad}");
        }

        let Command::Idle(i) = parse(&v(
            "mqtt-idle --port 1891 --connections 10000 --hold 2.5 --broker-pid 7",
        ))
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            (i.port, i.connections, i.broker_pid),
            (1891, 10000, Some(7))
        );
        assert_eq!(i.hold, Duration::from_millis(2500));
        assert_eq!((i.proto, i.tls, i.sources), (IdleProto::Mqtt, false, 1));
        let mqtt = |a: &str| parse_idle(IdleProto::Mqtt, &v(a));
        assert!(mqtt("--connections 0").is_err());
        assert!(mqtt("--connections 200000").is_err());
        assert!(mqtt("--host 192.168.1.1").is_err());
        assert!(mqtt("--sources 0").is_err());
        assert!(mqtt("--sources 255").is_err());

        let Command::Idle(i) = parse(&v("amqp-idle --tls --sources 8 --port 5671")).unwrap() else {
            panic!()
        };
        assert_eq!(
            (i.proto, i.tls, i.sources, i.port),
            (IdleProto::Amqp, true, 8, 5671)
        );
        let Command::Idle(i) = parse(&v("stomp-idle")).unwrap() else {
            panic!()
        };
        assert_eq!((i.proto, i.port), (IdleProto::Stomp, 61613));
    }

    #[test]
    fn fleet_options() {
        let Command::Fleet(f) = parse(&v(
            "fleet --triad target/release/triad --sessions 10000 --block 500 --parallel 20 \
             --idle-connections 5000 --sources 8 --time-limit 300 --no-restart --json --publish 10",
        ))
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            f.target,
            FleetTarget::Triad(PathBuf::from("target/release/triad"))
        );
        assert_eq!((f.sessions, f.block, f.parallel), (10000, 500, 20));
        assert_eq!((f.idle_connections, f.sources), (5000, 8));
        assert_eq!(f.time_limit, Duration::from_secs(300));
        assert!(!f.restart && f.json);
        assert_eq!(f.publish, Some(10));
        let r = parse_fleet(&v(
            "--port 1890 --broker-pid 9 --data-dir /x --name rabbitmq",
        ))
        .unwrap();
        assert_eq!(
            r.target,
            FleetTarget::Running {
                host: "127.0.0.1".into(),
                port: 1890,
                pid: Some(9),
                data_dir: Some(PathBuf::from("/x"))
            }
        );
        assert_eq!(r.name.as_deref(), Some("rabbitmq"));
        for bad in [
            "",
            "--triad t --port 1",
            "--triad t --mosquitto m",
            "--broker-pid 3",
            "--host 10.0.0.1 --port 1",
            "--triad t --sessions 0",
            "--triad t --sessions 10 --block 100",
            "--triad t --sources 300",
        ] {
            assert!(parse_fleet(&v(bad)).is_err(), "{bad}");
        }
    }
}
