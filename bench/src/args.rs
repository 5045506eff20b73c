//! Command line: clap (derive) parses, then each subcommand's `check` enforces what
//! clap cannot say (one option bounded by another, loopback-only hosts, per-protocol
//! default ports) and fills in the derived fields.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::TypedValueParser;
use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "triad-bench",
    version,
    about = "Load generator for Triad (and, side by side, RabbitMQ and Mosquitto)",
    long_about = "Load generator for Triad (and, side by side, RabbitMQ and Mosquitto).\n\n\
        Every run prints its result as one JSON line on stdout (after a human summary \
        unless --json); progress goes to stderr. `triad-bench table` turns result lines \
        into a Markdown table. See BENCHMARKS.md for the scenarios and their results.",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// Appends through triad-store, one durable wait per append
    Store(StoreArgs),
    /// Baselines: dd bandwidth, write+fdatasync loops
    Disk(DiskArgs),
    /// Markdown table from result lines (FILE or stdin)
    Table {
        /// JSON result lines, one per run (default: stdin)
        file: Option<PathBuf>,
    },
    /// AMQP 0-9-1 producers and consumers (like RabbitMQ PerfTest)
    Amqp(AmqpArgs),
    /// STOMP 1.2 producers and consumers on /queue/<name>
    Stomp(StompArgs),
    /// MQTT 3.1.1 publishers and subscribers (like emqtt-bench)
    Mqtt(MqttArgs),
    /// N idle MQTT connections held open; broker RSS per connection
    MqttIdle(IdleArgs),
    /// N idle STOMP connections (CONNECT, heart-beat 0,0); broker RSS per connection
    StompIdle(IdleArgs),
    /// N idle AMQP connections (handshake and one open channel); broker RSS per connection
    AmqpIdle(IdleArgs),
    /// N persistent MQTT sessions: create rate per block, disk and RSS per session, restart time
    #[command(
        long_about = "N persistent MQTT sessions: create rate per block, disk and RSS per \
            session, restart time.\n\nDevice n: client id dev-<n>, clean session 0, \
            SUBSCRIBE dev/<n>/cmd QoS 1. The broker is one of --triad BIN, --mosquitto BIN, \
            or one already running (--port [--host] [--broker-pid] [--data-dir])."
    )]
    Fleet(FleetArgs),
    /// Durable queues and topic bindings: RssAnon per binding, restart time, routing cost
    #[command(
        long_about = "Durable queues and topic bindings: RssAnon per binding, restart time, \
            routing cost at that size.\n\nSession n: persistent MQTT client dev-<n> \
            subscribed at QoS 1 to dev/<n>/cmd and dev/<n>/f<j>/+/x in one SUBSCRIBE; \
            create, restart, then route."
    )]
    Bindings(BindingsArgs),
    /// Connection setup: connects/s and broker CPU per connect or per TLS handshake
    #[command(long_about = crate::connect::ABOUT)]
    Connect(ConnectArgs),
}

// ---- value parsers ----

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

fn size_usize(s: &str) -> Result<usize, String> {
    usize::try_from(parse_size(s)?).map_err(|_| format!("size {s:?} too large"))
}

/// Seconds in (0, 86400], fractions allowed.
fn secs(v: &str) -> Result<Duration, String> {
    let f: f64 = v
        .parse()
        .map_err(|_| format!("expected seconds, got {v:?}"))?;
    if !f.is_finite() || f <= 0.0 || f > 86_400.0 {
        return Err(format!("expected seconds in (0, 86400], got {v:?}"));
    }
    Ok(Duration::from_secs_f64(f))
}

/// A number of at least 1.
fn pos<T: std::str::FromStr + Default + PartialEq>(v: &str) -> Result<T, String> {
    let n: T = v
        .parse()
        .map_err(|_| format!("expected a number, got {v:?}"))?;
    if n == T::default() {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

fn rate(v: &str) -> Result<f64, String> {
    let r: f64 = v
        .parse()
        .map_err(|_| format!("expected a rate, got {v:?}"))?;
    if !r.is_finite() || r <= 0.0 {
        return Err(format!("expected a positive rate, got {v:?}"));
    }
    Ok(r)
}

/// Source addresses 127.0.0.1 ..= 127.0.0.K.
fn sources(v: &str) -> Result<u8, String> {
    match v.parse::<u16>() {
        Ok(n @ 1..=254) => Ok(n as u8),
        _ => Err(format!("expected 1 to 254, got {v:?}")),
    }
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

// ---- store ----

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Flush {
    /// group commit: each append waits for its fsync
    Sync,
    /// flushed every 200 ms or 16 MiB
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

#[derive(Args, Clone, Debug, PartialEq)]
pub struct StoreArgs {
    /// Parent of the data directory bench-data-<pid> (removed after unless --keep)
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,
    /// Message body size; suffixes k/K/KiB, m/M/MiB
    #[arg(long, value_name = "BYTES", default_value = "1024", value_parser = size_usize)]
    pub size: usize,
    /// Writer threads
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = pos::<usize>)]
    pub writers: usize,
    /// Durable queues; writer i appends to queue i % N
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = pos::<usize>)]
    pub queues: usize,
    /// Flush mode
    #[arg(long, value_enum, default_value_t = Flush::Sync)]
    pub flush: Flush,
    /// Total messages (split evenly over the writers)
    #[arg(long, value_name = "N", value_parser = pos::<u64>)]
    pub count: Option<u64>,
    /// Run time when --count is not given (default 5); with --count, a cap
    #[arg(long, value_name = "SECS", value_parser = secs)]
    pub duration: Option<Duration>,
    /// Commitlog segment size
    #[arg(long, value_name = "BYTES", default_value = "1GiB", value_parser = parse_size)]
    pub segment_size: u64,
    /// Then read everything back through read_queue and verify each body
    #[arg(long)]
    pub read: bool,
    /// Keep the data directory
    #[arg(long)]
    pub keep: bool,
    /// Run on tmpfs/ramfs (refused by default: we want the real disk)
    #[arg(long)]
    pub allow_tmpfs: bool,
    /// Print only the final JSON line on stdout
    #[arg(long)]
    pub json: bool,
    /// No progress line on stderr
    #[arg(long)]
    pub quiet: bool,
    /// Queues holding at most N entries use the shared index (store default 64); 0 = every
    /// queue has its own consume-queue files
    #[arg(long, value_name = "N")]
    pub small_queue_entries: Option<u64>,
    /// Entries per consume-queue file (store default 300000)
    #[arg(long, value_name = "N", value_parser = pos::<u64>)]
    pub cq_entries_per_file: Option<u64>,
    /// Instead of writers: the consume-queue layer alone, N queues with --per-queue entries
    /// each, then one busy queue of --busy entries; reports time, CPU, RssAnon, disk,
    /// mappings and fds per queue
    #[arg(long, value_name = "N", value_parser = pos::<u64>)]
    pub fleet: Option<u64>,
    /// Entries per fleet queue
    #[arg(long, value_name = "M", default_value_t = 1, value_parser = pos::<u64>)]
    pub per_queue: u64,
    /// Entries of the fleet mode's busy queue
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    pub busy: u64,
    /// Ack each message once durable (a consumer that keeps up); with retention every
    /// second, reports the log's size on disk
    #[arg(long)]
    pub consume: bool,
    /// With --consume: every Nth message also goes to one slow queue nobody consumes,
    /// which commitlog compaction must not let pin the log
    #[arg(long, value_name = "N", value_parser = pos::<u64>)]
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

    fn check(self) -> Result<Self, String> {
        let o = self;
        if o.queues > o.writers {
            return Err(format!(
                "--queues {} exceeds --writers {}: some queues would stay empty",
                o.queues, o.writers
            ));
        }
        if o.segment_size < 4096 {
            return Err("--segment-size must be at least 4096".into());
        }
        if matches!(o.small_queue_entries, Some(n) if n != 0 && n < 8) {
            return Err("--small-queue-entries must be 0 or at least 8".into());
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
}

// ---- disk ----

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DiskTest {
    /// dd bandwidth
    Dd,
    /// write+fdatasync, overwriting one block
    Overwrite,
    /// write+fdatasync, appending into a preallocated file
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

#[derive(Args, Clone, Debug, PartialEq)]
pub struct DiskArgs {
    /// Parent of the scratch directory
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,
    /// Write size of the fdatasync loops
    #[arg(long, value_name = "BYTES", default_value = "1024", value_parser = size_usize)]
    pub size: usize,
    /// Iterations of each loop (default: --duration)
    #[arg(long, value_name = "N", value_parser = pos::<u64>)]
    pub count: Option<u64>,
    /// Run time of each loop
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = secs)]
    pub duration: Duration,
    /// MiB written by dd
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = pos::<u64>)]
    pub dd_mib: u64,
    /// Size of the loops' preallocated file, MiB
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = pos::<u64>)]
    pub file_mib: u64,
    /// Comma list of tests
    #[arg(
        long = "test",
        value_name = "LIST",
        value_enum,
        value_delimiter = ',',
        default_value = "dd,overwrite,fallocated"
    )]
    pub tests: Vec<DiskTest>,
    /// Run on tmpfs/ramfs (refused by default)
    #[arg(long)]
    pub allow_tmpfs: bool,
    /// Print only the final JSON lines on stdout
    #[arg(long)]
    pub json: bool,
    /// No progress line on stderr
    #[arg(long)]
    pub quiet: bool,
}

impl DiskArgs {
    fn check(self) -> Result<Self, String> {
        if self.size == 0 {
            return Err("--size must be at least 1".into());
        }
        if (self.size as u64) > self.file_mib << 20 {
            return Err("--size exceeds --file-mib".into());
        }
        Ok(self)
    }
}

// ---- broker load (amqp, stomp, mqtt) ----

/// How many `--broker-pid` a load benchmark takes.
pub const MAX_BROKER_PIDS: usize = 8;

/// Options every broker benchmark takes.
#[derive(Args, Clone, Debug, PartialEq)]
pub struct LoadArgs {
    /// Broker address (loopback only)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Broker port [default: 5672 amqp, 61613 stomp, 1883 mqtt]
    #[arg(long = "port", value_name = "PORT")]
    port_flag: Option<u16>,
    /// The port in use (`--port` or the protocol's default).
    #[arg(skip)]
    pub port: u16,
    /// Producer connections
    #[arg(long, visible_alias = "publishers", value_name = "N", default_value_t = 1,
          value_parser = pos::<usize>)]
    pub producers: usize,
    /// Consumer connections [default: 1; amqp --fanout N: N]
    #[arg(long = "consumers", visible_alias = "subscribers", value_name = "N")]
    consumers_flag: Option<usize>,
    /// The consumers in use.
    #[arg(skip)]
    pub consumers: usize,
    /// Body size, at least 16 (bodies carry a stamp)
    #[arg(long, value_name = "BYTES", default_value = "1024", value_parser = size_usize)]
    pub size: usize,
    /// Messages published in all (split over the producers)
    #[arg(long, value_name = "N", value_parser = pos::<u64>)]
    pub count: Option<u64>,
    /// Publishing time when --count is not given (default 5); with --count, a cap
    #[arg(long, value_name = "SECS", value_parser = secs)]
    pub duration: Option<Duration>,
    /// Total publish rate, msgs/s (default: as fast as possible)
    #[arg(long, value_name = "R", value_parser = rate)]
    pub rate: Option<f64>,
    /// After publishing, give up when nothing arrives for this long
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = secs)]
    pub drain_timeout: Duration,
    /// Report the broker's CPU time per message and RSS (from /proc/PID); repeatable
    /// (at most 8): the processes' CPU and RSS are summed, e.g. a replica group's nodes
    #[arg(long, value_name = "PID", value_parser = pos::<u32>)]
    pub broker_pid: Vec<u32>,
    /// Client runtime threads
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = pos::<usize>)]
    pub threads: usize,
    /// User name
    #[arg(long, value_name = "U", default_value = "guest")]
    pub user: String,
    /// Password
    #[arg(long, value_name = "P", default_value = "guest")]
    pub pass: String,
    /// Only the JSON line on stdout
    #[arg(long)]
    pub json: bool,
    /// No progress line on stderr
    #[arg(long)]
    pub quiet: bool,
    /// After the run, list on stderr each 5 ms window of send times that had messages
    /// slower than MS (count, max latency, producers), with the run's clock origin in
    /// CLOCK_MONOTONIC ns (for `perf -k mono`)
    #[arg(long, value_name = "MS", value_parser = pos::<u64>)]
    pub slow_ms: Option<u64>,
}

impl LoadArgs {
    /// The publishing time cap: `--duration`, or 5 s unless a `--count` bounds the run.
    pub fn time_cap(&self) -> Option<Duration> {
        match (self.count, self.duration) {
            (_, Some(d)) => Some(d),
            (None, None) => Some(Duration::from_secs(5)),
            (Some(_), None) => None,
        }
    }

    /// Fills in the port and consumers, and checks what every protocol shares.
    fn check(&mut self, default_port: u16, default_consumers: usize) -> Result<(), String> {
        self.port = self.port_flag.unwrap_or(default_port);
        self.consumers = self.consumers_flag.unwrap_or(default_consumers);
        loopback(&self.host)?;
        if self.size < crate::e2e::STAMP || self.size > 64 << 20 {
            return Err(format!(
                "--size must be in [{}, 64 MiB]: bodies carry a {}-byte stamp",
                crate::e2e::STAMP,
                crate::e2e::STAMP
            ));
        }
        if self.broker_pid.len() > MAX_BROKER_PIDS {
            return Err(format!("--broker-pid: at most {MAX_BROKER_PIDS}"));
        }
        if let Some(c) = self.count {
            if c > u64::from(u32::MAX) {
                return Err("--count: at most 2^32 - 1".into());
            }
            if c < self.producers as u64 {
                return Err("--count is smaller than --producers".into());
            }
        }
        Ok(())
    }
}

#[derive(Args, Clone, Debug, PartialEq)]
pub struct AmqpArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// Queues; producer i publishes to queue i % N, consumer j reads queue j % N
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = pos::<usize>)]
    pub queues: usize,
    /// N queues bound to one fanout exchange instead (every message to each)
    #[arg(long, value_name = "N", value_parser = pos::<usize>)]
    pub fanout: Option<usize>,
    /// Durable queues, delivery-mode 2
    #[arg(long)]
    pub persistent: bool,
    /// Publisher confirms, at most --confirm-window unconfirmed
    #[arg(long)]
    pub confirm: bool,
    /// Unconfirmed publishes per producer with --confirm
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = pos::<usize>)]
    pub confirm_window: usize,
    /// Consumers ack (multiple); default no-ack
    #[arg(long)]
    pub manual_ack: bool,
    /// basic.qos prefetch-count (with --manual-ack; 0: none)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub prefetch: u16,
    /// Virtual host
    #[arg(long, value_name = "V", default_value = "/")]
    pub vhost: String,
    /// The queues' type: `quorum` declares them durable with x-queue-type=quorum (needs
    /// --persistent; RabbitMQ's replicated queues: a broker without them refuses the
    /// declare and the run stops); `stream` is --stream
    #[arg(long, value_enum, default_value_t = QueueType::Classic)]
    pub queue_type: QueueType,
    /// Stream replay: declare the queues as stream queues (x-queue-type=stream), publish
    /// --count messages first (with confirms), then start the consumers at
    /// x-stream-offset=first and measure only their read of the whole stream (one
    /// consumer per queue: --consumers must equal --queues). Implies --persistent
    /// --confirm --manual-ack; --prefetch defaults to 1000.
    #[arg(long)]
    pub stream: bool,
    /// Delayed messages: publish --count messages each due MS after it is sent, consume
    /// them and report throughput, the delivery-time error (arrival - due: p50/p99/max)
    /// and, with --broker-pid, broker CPU per message and RssAnon with all pending
    #[arg(long, value_name = "MS", value_parser = pos::<u64>)]
    pub delayed: Option<u64>,
    /// How --delayed delays: Triad's (and the RabbitMQ plugin's) x-delay header, or
    /// RabbitMQ's workaround, a per-message expiration in a queue dead-lettering into
    /// the consumed one
    #[arg(long, value_enum, default_value = "x-delay")]
    pub delay_via: DelayVia,
    /// With --delayed: publish only (memory of the pending messages); they stay pending
    #[arg(long)]
    pub no_consume: bool,
}

/// `--queue-type`: the x-queue-type the queues are declared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QueueType {
    /// no x-queue-type argument
    Classic,
    /// x-queue-type=quorum (durable)
    Quorum,
    /// x-queue-type=stream (the same as --stream)
    Stream,
}

impl QueueType {
    pub fn name(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
            QueueType::Stream => "stream",
        }
    }
}

/// How `--delayed` delays a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DelayVia {
    /// an x-delay header (ms)
    XDelay,
    /// per-message expiration in a TTL queue with a dead-letter exchange
    TtlDlx,
}

impl AmqpArgs {
    fn check(mut self) -> Result<Self, String> {
        let groups = self.fanout.unwrap_or(self.queues);
        let default_consumers = if self.fanout.is_some() { groups } else { 1 };
        self.load.check(5672, default_consumers)?;
        let o = self;
        if o.load.consumers < groups {
            return Err(format!(
                "--consumers {} < {groups} queues: some queues would have no consumer",
                o.load.consumers
            ));
        }
        if o.fanout.is_none() && o.queues > o.load.producers {
            return Err("--queues exceeds --producers: some queues would stay empty".into());
        }
        let mut o = o;
        if o.delay_via != DelayVia::XDelay && o.delayed.is_none() {
            return Err("--delay-via needs --delayed".into());
        }
        if o.no_consume && o.delayed.is_none() {
            return Err("--no-consume needs --delayed".into());
        }
        if o.queue_type == QueueType::Stream {
            o.stream = true;
        }
        if o.queue_type == QueueType::Quorum {
            if !o.persistent {
                return Err(
                    "--queue-type quorum needs --persistent (quorum queues are durable)".into(),
                );
            }
            if o.stream || o.delayed.is_some() {
                return Err("--queue-type quorum takes no --stream or --delayed".into());
            }
        }
        if o.delayed.is_some() {
            if o.load.broker_pid.len() > 1 {
                return Err("--delayed takes one --broker-pid".into());
            }
            if o.load.count.is_none() {
                return Err("--delayed needs --count".into());
            }
            if o.stream || o.fanout.is_some() || o.queues != 1 || o.load.producers != 1 {
                return Err(
                    "--delayed runs one producer and one consumer on one queue: no --stream, --fanout, --queues or --producers"
                        .into(),
                );
            }
            if o.manual_ack {
                return Err("--delayed takes no --manual-ack (its consumer is no-ack)".into());
            }
            if o.load.size < 16 {
                return Err("--delayed needs --size of at least 16".into());
            }
        }
        if o.stream {
            if o.load.count.is_none() {
                return Err("--stream needs --count (the messages to publish first)".into());
            }
            if o.fanout.is_some() {
                return Err("--stream takes --queues, not --fanout".into());
            }
            // every consumer of a stream reads all of it: a second one on a queue would
            // count its messages twice
            if o.load.consumers != o.queues {
                return Err(format!(
                    "--stream needs --consumers = --queues (one reader per stream), not {} and {}",
                    o.load.consumers, o.queues
                ));
            }
            o.persistent = true;
            o.confirm = true;
            o.manual_ack = true;
            if o.prefetch == 0 {
                o.prefetch = 1000;
            }
        }
        if o.prefetch > 0 && !o.manual_ack {
            return Err("--prefetch needs --manual-ack".into());
        }
        Ok(o)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StompAck {
    /// no ACK frames
    Auto,
    /// cumulative ACKs
    Client,
    /// one ACK per message
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

#[derive(Args, Clone, Debug, PartialEq)]
pub struct StompArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// Queues, destinations /queue/<name>; producer i sends to queue i % N
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = pos::<usize>)]
    pub queues: usize,
    /// persistent:true on SEND
    #[arg(long)]
    pub persistent: bool,
    /// A receipt on every SEND, at most --receipt-window pending
    #[arg(long)]
    pub receipts: bool,
    /// Pending receipts per producer with --receipts
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = pos::<usize>)]
    pub receipt_window: usize,
    /// Ack mode of SUBSCRIBE (client acks cumulatively)
    #[arg(long, value_enum, default_value_t = StompAck::Auto)]
    pub ack: StompAck,
    /// prefetch-count header on SUBSCRIBE
    #[arg(long, value_name = "N", value_parser = pos::<u32>)]
    pub prefetch: Option<u32>,
    /// host header of CONNECT
    #[arg(long, value_name = "V", default_value = "/")]
    pub vhost: String,
    /// A header on every SEND, `name:value` (repeatable)
    #[arg(long, value_name = "NAME:VALUE")]
    pub header: Vec<String>,
    /// selector header of SUBSCRIBE (SQL92), to measure the cost of filtering
    #[arg(long, value_name = "SQL")]
    pub selector: Option<String>,
}

impl StompArgs {
    fn check(mut self) -> Result<Self, String> {
        self.load.check(61613, 1)?;
        let o = self;
        if o.load.consumers == 0 {
            return Err("--consumers must be at least 1".into());
        }
        if o.load.consumers < o.queues {
            return Err("--consumers < --queues: some queues would have no consumer".into());
        }
        if o.queues > o.load.producers {
            return Err("--queues exceeds --producers: some queues would stay empty".into());
        }
        if let Some(h) = o
            .header
            .iter()
            .find(|h| !h.contains(':') || h.contains('\n'))
        {
            return Err(format!("--header '{h}' is not name:value"));
        }
        if o.selector.as_ref().is_some_and(|s| s.contains('\n')) {
            return Err("--selector cannot hold a newline".into());
        }
        Ok(o)
    }
}

#[derive(Args, Clone, Debug, PartialEq)]
pub struct MqttArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// Publish and subscribe QoS
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub qos: u8,
    /// Topic prefix [default: triad-bench/<pid>]
    #[arg(long, value_name = "T", default_value = "")]
    pub topic: String,
    /// Publisher i publishes to T/(i % N), subscriber j subscribes to T/(j % N)
    /// (1: every subscriber gets every message)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = pos::<usize>)]
    pub topics: usize,
    /// Unacknowledged QoS 1/2 publishes per publisher
    #[arg(long, value_name = "N", default_value_t = 100,
          value_parser = clap::value_parser!(u16).range(1..).map(usize::from))]
    pub inflight: usize,
}

impl MqttArgs {
    fn check(mut self) -> Result<Self, String> {
        self.load.check(1883, 1)?;
        if self.topic.is_empty() {
            self.topic = format!("triad-bench/{}", std::process::id());
        } else if self.topic.contains(['+', '#', '\0']) {
            return Err(format!("--topic {:?}: no wildcards", self.topic));
        }
        let o = self;
        if o.load.consumers == 0 {
            return Err("--subscribers must be at least 1".into());
        }
        if o.topics > o.load.producers || o.topics > o.load.consumers {
            return Err("--topics exceeds --publishers or --subscribers".into());
        }
        Ok(o)
    }
}

// ---- idle ----

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Proto {
    Mqtt,
    Stomp,
    Amqp,
}

/// The idle benchmarks' protocol (the same three).
pub type IdleProto = Proto;

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Proto::Mqtt => "mqtt",
            Proto::Stomp => "stomp",
            Proto::Amqp => "amqp",
        }
    }

    pub fn default_port(self, tls: bool) -> u16 {
        match (self, tls) {
            (Proto::Mqtt, false) => 1883,
            (Proto::Mqtt, true) => 8883,
            (Proto::Stomp, false) => 61613,
            (Proto::Stomp, true) => 61614,
            (Proto::Amqp, false) => 5672,
            (Proto::Amqp, true) => 5671,
        }
    }
}

#[derive(Args, Clone, Debug, PartialEq)]
pub struct IdleArgs {
    /// Set from the subcommand.
    #[arg(skip = Proto::Mqtt)]
    pub proto: IdleProto,
    /// Over TLS (the server certificate is not verified; give the TLS port)
    #[arg(long)]
    pub tls: bool,
    /// TLS version offered [default: 1.3 and 1.2, the server picks]
    #[arg(long, value_enum, requires = "tls")]
    pub tls_version: Option<TlsVersion>,
    /// Connect from 127.0.0.1 ..= 127.0.0.K in turn, so that many connections do not run
    /// out of ephemeral ports
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = sources)]
    pub sources: u8,
    /// Broker address (loopback only)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Broker port [default: 1883 mqtt, 61613 stomp, 5672 amqp]
    #[arg(long = "port", value_name = "PORT")]
    port_flag: Option<u16>,
    #[arg(skip)]
    pub port: u16,
    /// Idle clients to connect (at most 100000)
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    pub connections: usize,
    /// How long to hold them once all are connected
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = secs)]
    pub hold: Duration,
    /// Connects in flight at once
    #[arg(long, value_name = "N", default_value_t = 200, value_parser = pos::<usize>)]
    pub parallel: usize,
    /// Report the broker's RSS and CPU (from /proc/PID)
    #[arg(long, value_name = "PID", value_parser = pos::<u32>)]
    pub broker_pid: Option<u32>,
    /// User name [default: guest]
    #[arg(long, value_name = "U")]
    pub user: Option<String>,
    /// Password [default: guest]
    #[arg(long, value_name = "P")]
    pub pass: Option<String>,
    /// Only the JSON line on stdout
    #[arg(long)]
    pub json: bool,
    /// No progress line on stderr
    #[arg(long)]
    pub quiet: bool,
}

impl IdleArgs {
    fn check(mut self, proto: Proto) -> Result<Self, String> {
        self.proto = proto;
        self.port = self.port_flag.unwrap_or(proto.default_port(false));
        loopback(&self.host)?;
        Ok(self)
    }
}

// ---- fleet ----

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

impl Default for FleetTarget {
    fn default() -> Self {
        FleetTarget::Running {
            host: "127.0.0.1".into(),
            port: 0,
            pid: None,
            data_dir: None,
        }
    }
}

#[derive(Args, Clone, Debug, PartialEq)]
pub struct FleetArgs {
    /// Start this Triad binary on a fresh data directory under --dir (ephemeral ports)
    #[arg(long, value_name = "BIN", help_heading = "Broker (one of)")]
    triad: Option<PathBuf>,
    /// Start Mosquitto (persistence true) on a fresh directory under --dir
    #[arg(long, value_name = "BIN", help_heading = "Broker (one of)")]
    mosquitto: Option<PathBuf>,
    /// A broker already running: its address (loopback only) [default: 127.0.0.1]
    #[arg(long, help_heading = "Broker (one of)")]
    host: Option<String>,
    /// A broker already running: its MQTT port
    #[arg(long, value_name = "PORT", value_parser = pos::<u16>, help_heading = "Broker (one of)")]
    port: Option<u16>,
    /// A broker already running: its pid, for CPU and RSS (the restart is not measured)
    #[arg(long = "broker-pid", value_name = "PID", value_parser = pos::<u32>,
          help_heading = "Broker (one of)")]
    pid: Option<u32>,
    /// A broker already running: its data directory, for disk per session
    #[arg(long, value_name = "DIR", help_heading = "Broker (one of)")]
    data_dir: Option<PathBuf>,
    /// The broker, from the options above.
    #[arg(skip)]
    pub target: FleetTarget,
    /// Label in the result [default: triad, mosquitto, or "broker"]
    #[arg(long)]
    pub name: Option<String>,
    /// Persistent sessions to create (at most 1000000)
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000).map(|n| n as usize))]
    pub sessions: usize,
    /// Sessions per rate block
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = pos::<usize>)]
    pub block: usize,
    /// Sessions being created at once
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = pos::<usize>)]
    pub parallel: usize,
    /// Sessions reconnected and held open for RSS per connection (0 skips)
    #[arg(long, value_name = "N", default_value_t = 19_000)]
    pub idle_connections: usize,
    /// How long they are held before RSS is read
    #[arg(long, value_name = "SECS", default_value = "2", value_parser = secs)]
    pub hold: Duration,
    /// Queue a message for the first N sessions only [default: all]
    #[arg(long, value_name = "N")]
    pub publish: Option<usize>,
    /// Source addresses 127.0.0.1 ..= 127.0.0.N
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = sources)]
    pub sources: u8,
    /// Cap on each phase; a phase cut short says so
    #[arg(long, value_name = "SECS", default_value = "600", value_parser = secs)]
    pub time_limit: Duration,
    /// Do not stop and restart the broker started here
    #[arg(long = "no-restart", action = clap::ArgAction::SetFalse)]
    pub restart: bool,
    /// Where the data directory goes
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,
    /// Keep the data directory
    #[arg(long)]
    pub keep: bool,
    /// Run on tmpfs/ramfs (refused by default)
    #[arg(long)]
    pub allow_tmpfs: bool,
    /// User name [default: none]
    #[arg(long, value_name = "U")]
    pub user: Option<String>,
    /// Password
    #[arg(long, value_name = "P")]
    pub pass: Option<String>,
    /// Client runtime threads
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = pos::<usize>)]
    pub threads: usize,
    /// Only the JSON line on stdout
    #[arg(long)]
    pub json: bool,
    /// No progress line on stderr
    #[arg(long)]
    pub quiet: bool,
}

impl FleetArgs {
    fn check(mut self) -> Result<Self, String> {
        let running = self.host.is_some()
            || self.port.is_some()
            || self.pid.is_some()
            || self.data_dir.is_some();
        self.target = match (self.triad.clone(), self.mosquitto.clone(), running) {
            (Some(b), None, false) => FleetTarget::Triad(b),
            (None, Some(b), false) => FleetTarget::Mosquitto(b),
            (None, None, true) => {
                let host = self.host.clone().unwrap_or_else(|| "127.0.0.1".into());
                loopback(&host)?;
                FleetTarget::Running {
                    host,
                    port: self.port.ok_or("--port is needed for a running broker")?,
                    pid: self.pid,
                    data_dir: self.data_dir.clone(),
                }
            }
            (None, None, false) => {
                return Err("fleet: give --triad BIN, --mosquitto BIN or --port PORT".into())
            }
            _ => {
                return Err(
                    "fleet: --triad, --mosquitto and --host/--port/--broker-pid/\
                     --data-dir exclude each other"
                        .into(),
                )
            }
        };
        if self.block > self.sessions {
            return Err("--block exceeds --sessions: no block would complete".into());
        }
        Ok(self)
    }
}

// ---- bindings ----

#[derive(Args, Clone, Debug, PartialEq)]
pub struct BindingsArgs {
    /// Start this Triad binary on a fresh data directory under --dir (the bench restarts it)
    #[arg(long, value_name = "BIN", required = true)]
    pub triad: PathBuf,
    /// Sessions, i.e. durable queues (at most 10000000)
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000).map(|n| n as usize))]
    pub queues: usize,
    /// Subscriptions in all, spread evenly over the sessions (at most 100000000)
    #[arg(long, value_name = "N", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..=100_000_000).map(|n| n as usize))]
    pub bindings: usize,
    /// Sessions being created at once
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = pos::<usize>)]
    pub parallel: usize,
    /// Unconfirmed publishes in the route phase
    #[arg(long, value_name = "N", default_value_t = 500, value_parser = pos::<usize>)]
    pub window: usize,
    /// Mandatory transient AMQP messages to amq.topic after the restart, each matching
    /// one binding (0 skips)
    #[arg(long, value_name = "N", default_value_t = 200_000)]
    pub publish: usize,
    /// Cap on each phase
    #[arg(long, value_name = "SECS", default_value = "1800", value_parser = secs)]
    pub time_limit: Duration,
    /// Where the data directory goes
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,
    /// Keep the data directory
    #[arg(long)]
    pub keep: bool,
    /// Run on tmpfs/ramfs (refused by default)
    #[arg(long)]
    pub allow_tmpfs: bool,
    /// Client runtime threads
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = pos::<usize>)]
    pub threads: usize,
    /// Only the JSON line on stdout
    #[arg(long)]
    pub json: bool,
    /// No progress line on stderr
    #[arg(long)]
    pub quiet: bool,
}

impl BindingsArgs {
    fn check(self) -> Result<Self, String> {
        if self.bindings < self.queues {
            return Err("bindings: --bindings must be at least --queues (one per queue)".into());
        }
        Ok(self)
    }
}

// ---- connect ----

/// What one connect of `triad-bench connect` does after TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ConnectProto {
    /// MQTT 3.1.1: CONNECT, CONNACK, DISCONNECT
    Mqtt,
    /// STOMP 1.2: CONNECT, CONNECTED, DISCONNECT
    Stomp,
    /// AMQP 0-9-1: handshake, connection.close
    Amqp,
    /// The TLS handshake alone (needs --tls), then close_notify
    Tls,
}

impl ConnectProto {
    pub fn name(self) -> &'static str {
        match self {
            ConnectProto::Mqtt => "mqtt",
            ConnectProto::Stomp => "stomp",
            ConnectProto::Amqp => "amqp",
            ConnectProto::Tls => "tls",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TlsVersion {
    /// TLS 1.2 only
    #[value(name = "1.2")]
    V12,
    /// TLS 1.3 only
    #[value(name = "1.3")]
    V13,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MqttSession {
    /// clean session 1: the broker drops the session at disconnect
    Clean,
    /// clean session 0: each client reconnects to its own stored session
    Persistent,
}

#[derive(Args, Clone, Debug, PartialEq)]
pub struct ConnectArgs {
    /// What each connect does after TCP (and TLS)
    #[arg(long, value_enum, default_value_t = ConnectProto::Mqtt)]
    pub proto: ConnectProto,
    /// Broker address (loopback only)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Broker port [default: the protocol's: 1883/8883 mqtt, 61613/61614 stomp, 5672/5671 amqp]
    #[arg(long = "port", value_name = "PORT", value_parser = pos::<u16>)]
    port_flag: Option<u16>,
    #[arg(skip)]
    pub port: u16,
    /// Over TLS (rustls client; the server certificate is not verified: loopback only)
    #[arg(long)]
    pub tls: bool,
    /// TLS version offered [default: 1.3 and 1.2, the server picks]
    #[arg(long, value_enum, requires = "tls")]
    pub tls_version: Option<TlsVersion>,
    /// Resume TLS sessions (client session cache: TLS 1.3 tickets, TLS 1.2 session ids
    /// and tickets); without it every handshake is a full one
    #[arg(long, requires = "tls")]
    pub resume: bool,
    /// MQTT session kind
    #[arg(long, value_enum, default_value_t = MqttSession::Clean)]
    pub session: MqttSession,
    /// Clients connecting at once; each connects, completes the protocol's handshake,
    /// disconnects, waits for the broker to close, and connects again
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=10_000).map(|n| n as usize))]
    pub parallel: usize,
    /// Connects in all (the run stops at --count or --time-limit, whichever first)
    #[arg(long, value_name = "N", value_parser = pos::<u64>)]
    pub count: Option<u64>,
    /// Run time [default: 10 s]
    #[arg(long, value_name = "SECS", value_parser = secs)]
    pub time_limit: Option<Duration>,
    /// Connects before the measurement starts (fills caches, creates persistent
    /// sessions, obtains the first TLS session); at least one per client
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warmup: u64,
    /// Connect from 127.0.0.1 ..= 127.0.0.K in turn, so that TIME_WAITs do not exhaust
    /// the ephemeral ports
    #[arg(long, value_name = "K", default_value_t = 16, value_parser = sources)]
    pub sources: u8,
    /// Broker CPU (utime+stime from /proc/PID/stat) per connect
    #[arg(long, value_name = "PID", value_parser = pos::<u32>)]
    pub broker_pid: Option<u32>,
    /// User name (mqtt: none unless given; stomp, amqp: guest)
    #[arg(long, value_name = "U")]
    pub user: Option<String>,
    /// Password
    #[arg(long, value_name = "P")]
    pub pass: Option<String>,
    /// Label in the result (e.g. triad, mosquitto, rabbitmq)
    #[arg(long)]
    pub name: Option<String>,
    /// Client runtime threads
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = pos::<usize>)]
    pub threads: usize,
    /// Only the JSON line on stdout
    #[arg(long)]
    pub json: bool,
    /// No progress line on stderr
    #[arg(long)]
    pub quiet: bool,
}

impl ConnectArgs {
    fn check(mut self) -> Result<Self, String> {
        loopback(&self.host)?;
        if self.proto == ConnectProto::Tls && !self.tls {
            return Err("--proto tls measures the TLS handshake: it needs --tls".into());
        }
        if self.session == MqttSession::Persistent && self.proto != ConnectProto::Mqtt {
            return Err("--session persistent is an MQTT session kind: use --proto mqtt".into());
        }
        let proto = match self.proto {
            ConnectProto::Mqtt | ConnectProto::Tls => Proto::Mqtt,
            ConnectProto::Stomp => Proto::Stomp,
            ConnectProto::Amqp => Proto::Amqp,
        };
        self.port = self.port_flag.unwrap_or(proto.default_port(self.tls));
        if self.time_limit.is_none() && self.count.is_none() {
            self.time_limit = Some(Duration::from_secs(10));
        }
        Ok(self)
    }
}

// ---- the command ----

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
    Connect(ConnectArgs),
    Table(Option<PathBuf>),
}

/// What parsing ended in: a command to run, or text to print and an exit code (help,
/// version, and errors, which clap formats with a usage line).
pub enum Parsed {
    Run(Box<Command>),
    Exit(clap::Error),
}

/// Parses `argv` (without the program name); errors as text.
#[cfg(test)]
pub fn parse(args: &[String]) -> Result<Command, String> {
    match parse_clap(args) {
        Parsed::Run(c) => Ok(*c),
        Parsed::Exit(e) => Err(e.to_string()),
    }
}

pub fn parse_clap(args: &[String]) -> Parsed {
    let argv = std::iter::once("triad-bench".to_string()).chain(args.iter().cloned());
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => return Parsed::Exit(e),
    };
    let checked = match cli.cmd {
        Sub::Store(a) => a.check().map(Command::Store),
        Sub::Disk(a) => a.check().map(Command::Disk),
        Sub::Table { file } => Ok(Command::Table(file)),
        Sub::Amqp(a) => a.check().map(Command::Amqp),
        Sub::Stomp(a) => a.check().map(Command::Stomp),
        Sub::Mqtt(a) => a.check().map(Command::Mqtt),
        Sub::MqttIdle(a) => a.check(Proto::Mqtt).map(Command::Idle),
        Sub::StompIdle(a) => a.check(Proto::Stomp).map(Command::Idle),
        Sub::AmqpIdle(a) => a.check(Proto::Amqp).map(Command::Idle),
        Sub::Fleet(a) => a.check().map(Command::Fleet),
        Sub::Bindings(a) => a.check().map(Command::Bindings),
        Sub::Connect(a) => a.check().map(Command::Connect),
    };
    match checked {
        Ok(c) => Parsed::Run(Box::new(c)),
        Err(msg) => {
            use clap::CommandFactory;
            let mut cmd = Cli::command();
            cmd.build();
            let sub = args.first().map(String::as_str).unwrap_or("");
            let e = match cmd.find_subcommand_mut(sub) {
                Some(s) => s.error(clap::error::ErrorKind::ValueValidation, msg),
                None => cmd.error(clap::error::ErrorKind::ValueValidation, msg),
            };
            Parsed::Exit(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn sub(cmd: &str, rest: &str) -> Result<Command, String> {
        parse(&v(&format!("{cmd} {rest}")))
    }

    fn parse_store(rest: &str) -> Result<StoreArgs, String> {
        match sub("store", rest)? {
            Command::Store(a) => Ok(a),
            c => panic!("{c:?}"),
        }
    }

    fn parse_amqp(rest: &str) -> Result<AmqpArgs, String> {
        match sub("amqp", rest)? {
            Command::Amqp(a) => Ok(a),
            c => panic!("{c:?}"),
        }
    }

    fn parse_stomp(rest: &str) -> Result<StompArgs, String> {
        match sub("stomp", rest)? {
            Command::Stomp(a) => Ok(a),
            c => panic!("{c:?}"),
        }
    }

    fn parse_mqtt(rest: &str) -> Result<MqttArgs, String> {
        match sub("mqtt", rest)? {
            Command::Mqtt(a) => Ok(a),
            c => panic!("{c:?}"),
        }
    }

    fn parse_fleet(rest: &str) -> Result<FleetArgs, String> {
        match sub("fleet", rest)? {
            Command::Fleet(a) => Ok(a),
            c => panic!("{c:?}"),
        }
    }

    fn parse_connect(rest: &str) -> Result<ConnectArgs, String> {
        match sub("connect", rest)? {
            Command::Connect(a) => Ok(a),
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn help_and_version_are_not_errors_to_run() {
        for a in [
            "--help",
            "store --help",
            "connect --help",
            "help fleet",
            "--version",
        ] {
            match parse_clap(&v(a)) {
                Parsed::Exit(e) => assert!(!e.use_stderr(), "{a}: {e}"),
                Parsed::Run(c) => panic!("{a}: ran {c:?}"),
            }
        }
        // no subcommand: the usage, as an error
        assert!(parse(&[]).is_err());
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
        let a = parse_store("").unwrap();
        assert_eq!(a, StoreArgs::default());
        assert_eq!(a.time_cap(), Some(Duration::from_secs(5)));
    }

    #[test]
    fn store_all_options() {
        let a = parse_store(
            "--dir /data --size=64k --writers 64 --queues 8 --flush async --count 1000 \
             --segment-size 64M --read --keep --json --quiet --allow-tmpfs",
        )
        .unwrap();
        assert_eq!(a.dir, PathBuf::from("/data"));
        assert_eq!(a.size, 65536);
        assert_eq!((a.writers, a.queues), (64, 8));
        assert_eq!(a.flush, Flush::Async);
        assert_eq!(a.count, Some(1000));
        assert_eq!(a.time_cap(), None);
        assert_eq!(a.segment_size, 64 << 20);
        assert!(a.read && a.keep && a.json && a.quiet && a.allow_tmpfs);
        let b = parse_store("--count 10 --duration 0.5").unwrap();
        assert_eq!(b.time_cap(), Some(Duration::from_millis(500)));
        let c = parse_store(
            "--fleet 100000 --per-queue 2 --busy 10 --small-queue-entries 0 \
             --cq-entries-per-file 1024",
        )
        .unwrap();
        assert_eq!((c.fleet, c.per_queue, c.busy), (Some(100_000), 2, 10));
        assert_eq!(
            (c.small_queue_entries, c.cq_entries_per_file),
            (Some(0), Some(1024))
        );
        let d = parse_store("--consume --slow-every 100").unwrap();
        assert_eq!((d.consume, d.slow_every), (true, Some(100)));
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
            "--slow-every 5",
            "--consume --read",
        ] {
            assert!(parse_store(bad).is_err(), "{bad}");
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
        let Command::Disk(d) = parse(&v("disk")).unwrap() else {
            panic!()
        };
        assert_eq!(d.tests.len(), 3);
        assert_eq!((d.duration, d.file_mib), (Duration::from_secs(5), 512));
        assert!(parse(&v("disk --test nope")).is_err());
        assert!(parse(&v("disk --size 0")).is_err());
        assert_eq!(parse(&v("table")), Ok(Command::Table(None)));
        assert_eq!(
            parse(&v("table r.jsonl")),
            Ok(Command::Table(Some(PathBuf::from("r.jsonl"))))
        );
        assert!(parse(&v("frobnicate")).is_err());
    }

    #[test]
    fn amqp_options() {
        let a = parse_amqp(
            "--port 5680 --producers 4 --consumers 4 --queues 2 \
             --size 1k --count 1000 --persistent --confirm --confirm-window 50 --manual-ack \
             --prefetch 100 --user u --pass p --broker-pid 42 --rate 500 --json --quiet \
             --slow-ms 20",
        )
        .unwrap();
        assert_eq!((a.load.host.as_str(), a.load.port), ("127.0.0.1", 5680));
        assert_eq!((a.load.producers, a.load.consumers, a.queues), (4, 4, 2));
        assert_eq!((a.load.size, a.load.count), (1024, Some(1000)));
        assert!(a.persistent && a.confirm && a.manual_ack && a.load.json && a.load.quiet);
        assert_eq!((a.confirm_window, a.prefetch), (50, 100));
        assert_eq!((a.load.user.as_str(), a.load.pass.as_str()), ("u", "p"));
        assert_eq!(
            (&a.load.broker_pid[..], a.load.rate),
            (&[42][..], Some(500.0))
        );
        assert_eq!(a.queue_type, QueueType::Classic);
        assert_eq!(a.load.time_cap(), None);
        assert_eq!(a.load.slow_ms, Some(20));
        let st = parse_amqp("--stream --count 10 --queues 2 --producers 2 --consumers 2").unwrap();
        assert!(st.stream && st.manual_ack && st.prefetch == 1000);
        let q =
            parse_amqp("--queue-type quorum --persistent --broker-pid 1 --broker-pid 2").unwrap();
        assert_eq!(
            (q.queue_type, &q.load.broker_pid[..]),
            (QueueType::Quorum, &[1, 2][..])
        );
        let st2 = parse_amqp("--queue-type stream --count 10").unwrap();
        assert!(st2.stream && st2.confirm);
        let d = parse_amqp("--fanout 10").unwrap();
        assert_eq!(d.load.slow_ms, None);
        assert!(d.load.broker_pid.is_empty());
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
            "--stream --count 10 --consumers 2",
            "--stream --count 10 --queues 2 --producers 2 --consumers 3",
            "--prefetch 10",
            "--count 1 --producers 2",
            "--rate 0",
            "--port 70000",
            "--qos 1",
            "--slow-ms 0",
            "--queue-type quorum",
            "--queue-type quorum --persistent --stream --count 10",
            "--queue-type lazy",
            "--delayed 100 --count 10 --broker-pid 1 --broker-pid 2",
            "--broker-pid 1 --broker-pid 2 --broker-pid 3 --broker-pid 4 --broker-pid 5 \
             --broker-pid 6 --broker-pid 7 --broker-pid 8 --broker-pid 9",
        ] {
            assert!(parse_amqp(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn stomp_and_mqtt_options() {
        let s = parse_stomp(
            "--port 61620 --ack client-individual --receipts --receipt-window 10 --prefetch 5 --persistent",
        )
        .unwrap();
        assert_eq!(s.ack, StompAck::ClientIndividual);
        assert!(s.receipts && s.persistent);
        assert_eq!(
            (s.receipt_window, s.prefetch, s.load.port),
            (10, Some(5), 61620)
        );
        assert!(parse_stomp("--ack sometimes").is_err());
        assert!(parse_stomp("--consumers 0").is_err());

        let m = parse_mqtt(
            "--publishers 4 --subscribers 8 --topics 4 --qos 2 --topic t/x --inflight 10 --size 64",
        )
        .unwrap();
        assert_eq!((m.load.producers, m.load.consumers, m.topics), (4, 8, 4));
        assert_eq!(
            (m.qos, m.topic.as_str(), m.inflight, m.load.size),
            (2, "t/x", 10, 64)
        );
        assert_eq!(m.load.port, 1883);
        assert!(parse_mqtt("").unwrap().topic.starts_with("triad-bench/"));
        for bad in [
            "--qos 3",
            "--topic a/+",
            "--topics 2",
            "--inflight 70000",
            "--subscribers 0",
        ] {
            assert!(parse_mqtt(bad).is_err(), "{bad}");
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
        for bad in [
            "--connections 0",
            "--connections 200000",
            "--host 192.168.1.1",
            "--sources 0",
            "--sources 255",
        ] {
            assert!(sub("mqtt-idle", bad).is_err(), "{bad}");
        }

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
        let f = parse_fleet(
            "--triad target/release/triad --sessions 10000 --block 500 --parallel 20 \
             --idle-connections 5000 --sources 8 --time-limit 300 --no-restart --json --publish 10",
        )
        .unwrap();
        assert_eq!(
            f.target,
            FleetTarget::Triad(PathBuf::from("target/release/triad"))
        );
        assert_eq!((f.sessions, f.block, f.parallel), (10000, 500, 20));
        assert_eq!((f.idle_connections, f.sources), (5000, 8));
        assert_eq!(f.time_limit, Duration::from_secs(300));
        assert!(!f.restart && f.json);
        assert_eq!(f.publish, Some(10));
        assert!(parse_fleet("--triad t").unwrap().restart);
        let r = parse_fleet("--port 1890 --broker-pid 9 --data-dir /x --name rabbitmq").unwrap();
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
            assert!(parse_fleet(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn connect_options() {
        let c = parse_connect("").unwrap();
        assert_eq!(
            (c.proto, c.port, c.tls, c.parallel),
            (ConnectProto::Mqtt, 1883, false, 1)
        );
        assert_eq!(
            (c.time_limit, c.count),
            (Some(Duration::from_secs(10)), None)
        );
        assert_eq!((c.session, c.sources), (MqttSession::Clean, 16));
        let c = parse_connect(
            "--proto tls --tls --tls-version 1.2 --resume --port 8884 --parallel 8 \
             --count 5000 --broker-pid 3 --sources 4 --name triad",
        )
        .unwrap();
        assert_eq!(
            (c.proto, c.tls_version, c.resume),
            (ConnectProto::Tls, Some(TlsVersion::V12), true)
        );
        assert_eq!(
            (c.port, c.parallel, c.count, c.time_limit),
            (8884, 8, Some(5000), None)
        );
        let c = parse_connect("--tls --session persistent").unwrap();
        assert_eq!((c.port, c.session), (8883, MqttSession::Persistent));
        assert_eq!(parse_connect("--proto amqp --tls").unwrap().port, 5671);
        for bad in [
            "--proto tls",
            "--resume",
            "--tls-version 1.3",
            "--proto stomp --session persistent",
            "--parallel 0",
            "--host 10.1.1.1",
            "--count 0",
            "--time-limit 0",
            "--tls-version 1.1 --tls",
        ] {
            assert!(parse_connect(bad).is_err(), "{bad}");
        }
    }
}
