//! The `triad` broker binary: load the configuration, open the store, bind the
//! listeners, serve until SIGTERM or SIGINT, then shut down cleanly.
//!
//! # Output contract (scripts and `tests/common` parse it)
//!
//! Logs go to **stderr**, one event per line (tracing-subscriber's plain format,
//! `RUST_LOG` honoured, default `info`). Once *every* listener is bound, the broker
//! logs one line per protocol containing
//!
//! ```text
//! listening proto=<amqp|stomp|mqtt|http|amqps|stomps|mqtts|https> addr=<ip>:<port>
//! ```
//!
//! with the actual bound address (so port 0 shows the ephemeral port; IPv6 as
//! `[ip]:port`), e.g. `2025-01-01T00:00:00.000000Z  INFO triad: listening proto=amqp
//! addr=127.0.0.1:40123`. Find the substring `listening proto=` and split the rest on
//! spaces. The four plain listeners come first, always; the four TLS ones
//! (`amqps`, `stomps`, `mqtts`, `https`) follow only when `tls.cert_file` and
//! `tls.key_file` are set. After them comes one line containing `broker ready`; signal
//! handlers are installed before it, so a SIGTERM sent after it is always honoured.
//!
//! On shutdown it logs `shutdown requested signal=SIGTERM` (or `SIGINT`), waits up to
//! [`SHUTDOWN_GRACE`] for connections, closes the store (final checkpoint, `abort`
//! marker removed) and logs `stopped cleanly`; when the store could not be closed it
//! says so and exits non-zero instead.
//!
//! With `[cluster] etcd` (an elected group) the process first joins the election and
//! logs `joining the election`; while another node leads it logs `following ...` and
//! `follower: connected to the leader` and opens no client listener; once it wins it logs
//! `elected leader epoch=N`, then starts as above. A leader that loses its lease logs
//! `leadership lost` (from then on nothing is confirmed), shuts down as on SIGTERM
//! (`shutdown requested signal=leadership lost` ... `stopped cleanly`) and re-executes
//! itself with the same arguments and pid, to rejoin as a follower.
//!
//! A fatal startup error (bad config, unreadable or invalid TLS PEM file, store locked
//! by another broker, address in use) is one line on stderr starting with
//! `triad: error: `.
//!
//! SIGHUP does not stop the broker: it reloads the TLS certificate, key and CA files
//! (`TLS certificate reloaded`, or `TLS certificate reload failed; keeping the one in
//! use` at `error`).
//!
//! Exit codes: 0 clean shutdown; 1 runtime failure (store, bind, unclean close);
//! 2 bad command line or configuration (TLS files included).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;
use triad::cli::{Cli, Tool};
use triad::config::{Config, ConfigError};
use triad::listener::{ConnContext, Handler, Listener, Proto};
use triad::shutdown::StoreClose;
use triad::tls::{TlsConfigs, TlsHandler};
use triad_store::store::Store;

/// How long shutdown waits for open connections before closing the store anyway.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How long the store waits at shutdown for the last other handles to it to be let go.
const STORE_RELEASE_WAIT: Duration = Duration::from_secs(2);
/// How often the core's timers run (message TTL at queue heads, `x-expires`).
const TICK: Duration = Duration::from_millis(250);
/// How often MQTT `$SYS/broker/...` topics are published (Mosquitto: 10 s).
const SYS_INTERVAL: Duration = Duration::from_secs(10);

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(tool) = &cli.command {
        return run_tool(tool);
    }
    init_tracing();
    let config = match load_config(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("triad: error: {e}");
            return ExitCode::from(2);
        }
    };
    // The PEM files are part of the configuration: read and checked before anything
    // else, with the same exit code.
    let tls = match TlsConfigs::load(&config.tls) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("triad: error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&cli, config, tls) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("triad: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `triad hash-password`: prints the hash on stdout; exit code 2 on no password.
fn run_tool(tool: &Tool) -> ExitCode {
    match tool {
        Tool::HashPassword { password } => {
            let password = match password {
                Some(p) => p.clone(),
                None => {
                    let mut line = String::new();
                    if let Err(e) = std::io::stdin().read_line(&mut line) {
                        eprintln!("triad: error: cannot read the password from stdin: {e}");
                        return ExitCode::from(2);
                    }
                    line.trim_end_matches(['\n', '\r']).to_owned()
                }
            };
            if password.is_empty() {
                eprintln!("triad: error: empty password");
                return ExitCode::from(2);
            }
            match triad_core::PasswordHash::new(&password) {
                Ok(h) => {
                    println!("{}", h.to_base64());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("triad: error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn init_tracing() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn load_config(cli: &Cli) -> Result<Config, ConfigError> {
    let mut config = match &cli.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    cli.apply(&mut config);
    config.validate()?;
    Ok(config)
}

fn run(cli: &Cli, config: Config, tls: Option<Arc<TlsConfigs>>) -> anyhow::Result<()> {
    // Replication (issue 18): a follower serves no client, it copies its leader's logs;
    // an elected node follows until it wins a term.
    let Some(mut node) = triad::cluster::join(&config)? else {
        return Ok(());
    };
    let config = Arc::new(config);
    let s = &config.store;
    info!(
        config = ?cli.config,
        data_dir = %s.data_dir.display(),
        segment_size = %s.segment_size,
        flush = ?s.flush,
        repair = cli.repair,
        tls = tls.is_some(),
        "opening store"
    );
    // Blocking (recovery may read the whole commitlog tail), so before the runtime.
    let mut store_config = config.store_config(cli.repair);
    store_config.replica = node.gate();
    let store = Store::open(store_config)
        .with_context(|| format!("cannot open the store in {}", s.data_dir.display()))?;
    let store = Arc::new(store);
    let leader = node.start_leader(&config, Arc::clone(&store))?;
    let core_config = config
        .core_config()
        .context("invalid users or permissions")?;
    let broker = triad_core::Broker::open(Arc::clone(&store), core_config)
        .context("cannot load the broker's topology from the store")?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("triad-worker")
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(serve(
        Arc::clone(&config),
        Arc::clone(&broker),
        tls,
        leader.as_ref().map(|l| l.gate()),
        leader.as_ref().map(|l| l.status_handle()),
        node.serving(),
    ));
    drop(leader);
    drop(broker);
    // Tasks that outlived the grace period are dropped here, releasing what they hold.
    runtime.shutdown_timeout(Duration::from_secs(1));

    // The store is closed last, whether serving succeeded or not (e.g. a bind error),
    // and the log says whether it was.
    let closed = match triad::shutdown::close_store(store, STORE_RELEASE_WAIT) {
        StoreClose::Closed => Ok(()),
        StoreClose::Failed(e) => {
            Err(anyhow::anyhow!(e).context("the store did not close cleanly; the next start recovers it"))
        }
        StoreClose::StillReferenced { holders } => Err(anyhow::anyhow!(
            "the store was not closed: {holders} handle(s) still held after {STORE_RELEASE_WAIT:?}; \
             the next start recovers it (unclean shutdown)"
        )),
    };
    served?;
    closed?;
    info!("stopped cleanly");
    // a leader that lost its term comes back as a follower (re-exec)
    node.finish()
}

/// Reloads the TLS files; on failure the chain in use stays and the error is logged.
fn reload_tls(tls: &TlsConfigs, why: &str) {
    match tls.reload() {
        Ok(()) => info!(trigger = why, "TLS certificate reloaded"),
        Err(e) => tracing::error!(
            trigger = why,
            error = %e,
            "TLS certificate reload failed; keeping the one in use"
        ),
    }
}

/// Starts accepting on `socket` with `handler`, in a task the shutdown waits for.
fn spawn_listener<H: Handler>(
    socket: TcpListener,
    handler: H,
    ctx: ConnContext,
    limit: Option<Arc<Semaphore>>,
    tracker: &TaskTracker,
) {
    let l = Listener::new(socket, handler, ctx, limit, tracker.clone());
    tracker.spawn(l.run());
}

async fn serve(
    config: Arc<Config>,
    broker: Arc<triad_core::Broker>,
    tls: Option<Arc<TlsConfigs>>,
    replica_gate: Option<Arc<triad_store::replica::ReplicaGate>>,
    status: Option<triad_cluster::leader::StatusHandle>,
    cluster: triad::cluster::Serving,
) -> anyhow::Result<()> {
    // Installed before readiness is announced, so no early signal is lost.
    let mut signals = Signals::install()?;
    let bound = bind_listeners(&config, tls.is_some()).await?;

    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    let mqtt = triad_mqtt::MqttState::new(Arc::clone(&broker))
        .context("cannot load the MQTT retained messages and sessions")?;
    mqtt.spawn_sys(SYS_INTERVAL, shutdown.clone());
    if let Some(after) = config.mqtt.session_expiry {
        mqtt.spawn_session_expiry(after.get(), shutdown.clone());
    }
    // Replication: from here on (sync mode) confirms wait for replicas; the start-up
    // records above did not.
    if let Some(g) = replica_gate {
        g.arm();
    }
    let conn_limit = match config.limits.max_connections {
        0 => None,
        n => Some(Arc::new(Semaphore::new(n as usize))),
    };
    // The HTTP listeners take no slot before accept: each request takes one of
    // `http.max_requests` or gets 503 at once, and an upgraded WebSocket gives it back
    // for a WebSocket slot and a `limits.max_connections` one.
    let http_slots = Arc::new(triad::websocket::Slots::new(&config, conn_limit.clone()));
    let mut bound_addrs = Vec::with_capacity(bound.len());
    for (proto, socket) in &bound {
        let local = socket
            .local_addr()
            .with_context(|| format!("cannot read the {proto} listener's address"))?;
        bound_addrs.push((*proto, local));
    }
    cluster.clients_bound(&bound_addrs);
    let _ = http_slots.bound.set(bound_addrs);
    for (proto, socket) in bound {
        let local = socket
            .local_addr()
            .with_context(|| format!("cannot read the {proto} listener's address"))?;
        let ctx = ConnContext {
            proto,
            config: Arc::clone(&config),
            shutdown: shutdown.clone(),
            broker: Arc::clone(&broker),
            mqtt: Arc::clone(&mqtt),
            conn: None,
            peer_cert_cn: None,
            http: Arc::clone(&http_slots),
            cluster: status.clone(),
        };
        // Health probes do not count toward `limits.max_connections`; WebSockets do.
        let limit = match proto.plain() {
            Proto::Http => None,
            _ => conn_limit.clone(),
        };
        spawn_protocol(socket, ctx, limit, tls.as_ref(), &tracker)?;
        info!(%proto, addr = %local, "listening");
    }
    info!(pid = std::process::id(), "broker ready");

    let (signal_name, store_failed) =
        until_stop(&mut signals, &config, &broker, tls.as_ref(), cluster.lost()).await;
    info!(signal = %signal_name, "shutdown requested");
    shutdown.cancel();
    drain_connections(&tracker, &mut signals.sigint).await;
    match store_failed {
        Some(e) => Err(anyhow::anyhow!(e).context("the store failed; stopping")),
        None => Ok(()),
    }
}

/// The signals the broker answers, installed before readiness is announced.
struct Signals {
    sigterm: tokio::signal::unix::Signal,
    sigint: tokio::signal::unix::Signal,
    /// SIGHUP (systemd's ExecReload) reloads the TLS files instead of ending the broker.
    sighup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        Ok(Signals {
            sigterm: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
            sigint: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
            sighup: signal(SignalKind::hangup()).context("cannot handle SIGHUP")?,
        })
    }
}

/// Serves until a signal, a lost leadership or a store failure: runs the core's timers,
/// the resource alarms and the TLS reloads meanwhile. Returns why it stopped (and the
/// store's error, if that was why).
async fn until_stop(
    signals: &mut Signals,
    config: &Config,
    broker: &Arc<triad_core::Broker>,
    tls: Option<&Arc<TlsConfigs>>,
    leadership_lost: CancellationToken,
) -> (&'static str, Option<triad_store::StoreError>) {
    let watch_every = tls.and_then(|t| t.watch_interval());
    let mut watch = tokio::time::interval(watch_every.unwrap_or(Duration::from_secs(3600)));
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Timers (message TTL, x-expires) and the store's health: a failed flush stops the
    // broker rather than let it confirm what may not be on disk.
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut store_failed = None;
    let monitor = triad::monitor::ResourceMonitor::new(
        &config.store.data_dir,
        config.limits.memory_high_watermark.0,
        config.limits.disk_free_limit.bytes(),
    );
    let signal_name = loop {
        tokio::select! {
            _ = signals.sigterm.recv() => break "SIGTERM",
            _ = signals.sigint.recv() => break "SIGINT",
            _ = leadership_lost.cancelled() => break "leadership lost",
            _ = signals.sighup.recv() => match tls {
                Some(t) => reload_tls(t, "SIGHUP"),
                None => info!("SIGHUP: no TLS certificate to reload"),
            },
            _ = watch.tick(), if watch_every.is_some() => {
                if let Some(t) = tls.filter(|t| t.files_changed()) {
                    reload_tls(t, "files changed");
                }
            }
            _ = tick.tick() => {
                if let Err(e) = broker.store().health() {
                    store_failed = Some(e);
                    break "store failure";
                }
                broker.set_alarms(monitor.check_with_store(broker.store()));
                let b = Arc::clone(broker);
                // the core's timers may read the store: keep them off the async workers
                let _ = tokio::task::spawn_blocking(move || b.tick()).await;
            }
        }
    };
    (signal_name, store_failed)
}

/// Binds every listener first: readiness means every port is open. The TLS listeners
/// only with a certificate (the default configuration has none).
async fn bind_listeners(config: &Config, tls: bool) -> anyhow::Result<Vec<(Proto, TcpListener)>> {
    let tls_protos: &[Proto] = if tls { &Proto::TLS } else { &[] };
    let mut bound = Vec::with_capacity(Proto::ALL.len() + tls_protos.len());
    for &proto in Proto::ALL.iter().chain(tls_protos) {
        let addr = config.listeners.addr(proto);
        let socket = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for {proto} on {addr}"))?;
        bound.push((proto, socket));
    }
    Ok(bound)
}

/// Starts the accept loop of `ctx.proto`'s listener.
fn spawn_protocol(
    socket: TcpListener,
    ctx: ConnContext,
    limit: Option<Arc<Semaphore>>,
    tls: Option<&Arc<TlsConfigs>>,
    tracker: &TaskTracker,
) -> anyhow::Result<()> {
    let proto = ctx.proto;
    // The protocol adapters plug in here, one `Handler` per protocol; over TLS, the
    // same `Service` behind a `TlsHandler`.
    match (ctx.proto, tls) {
        (Proto::Http, _) => spawn_listener(socket, triad::http::serve, ctx, limit, tracker),
        (Proto::Amqp, _) => spawn_listener(socket, triad::adapters::amqp, ctx, limit, tracker),
        (Proto::Stomp, _) => spawn_listener(socket, triad::adapters::stomp, ctx, limit, tracker),
        (Proto::Mqtt, _) => spawn_listener(socket, triad::adapters::mqtt, ctx, limit, tracker),
        (Proto::Https, Some(t)) => spawn_listener(
            socket,
            TlsHandler::new(Arc::clone(t), triad::http::Http),
            ctx,
            limit,
            tracker,
        ),
        (Proto::Amqps, Some(t)) => spawn_listener(
            socket,
            TlsHandler::new(Arc::clone(t), triad::adapters::Amqp),
            ctx,
            limit,
            tracker,
        ),
        (Proto::Stomps, Some(t)) => spawn_listener(
            socket,
            TlsHandler::new(Arc::clone(t), triad::adapters::Stomp),
            ctx,
            limit,
            tracker,
        ),
        (Proto::Mqtts, Some(t)) => spawn_listener(
            socket,
            TlsHandler::new(Arc::clone(t), triad::adapters::Mqtt),
            ctx,
            limit,
            tracker,
        ),
        (Proto::Https | Proto::Amqps | Proto::Stomps | Proto::Mqtts, None) => {
            anyhow::bail!("{proto} listener bound without a TLS configuration")
        }
    }
    Ok(())
}

/// Waits (at most [`SHUTDOWN_GRACE`], or until a second SIGINT) for the connections to
/// close after the shutdown token was cancelled.
async fn drain_connections(tracker: &TaskTracker, sigint: &mut tokio::signal::unix::Signal) {
    tracker.close();
    tokio::select! {
        r = tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait()) => match r {
            Ok(()) => info!("all connections closed"),
            Err(_) => warn!(
                open = tracker.len(),
                grace = ?SHUTDOWN_GRACE,
                "connections still open after the grace period; closing them"
            ),
        },
        _ = sigint.recv() => warn!(open = tracker.len(), "second SIGINT: not waiting for connections"),
    }
}
