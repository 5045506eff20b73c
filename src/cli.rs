//! Command-line flags. Their names are an interface that scripts and the test harness
//! use; do not rename them.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::Config;

/// Triad: one broker for AMQP 0-9-1, STOMP 1.2 and MQTT 3.1.1 clients.
#[derive(Debug, Default, Parser)]
#[command(name = "triad", version)]
pub struct Cli {
    /// TOML configuration file (see triad.example.toml); without it, the defaults.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Data directory; overrides store.data_dir.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// AMQP listen address; overrides listeners.amqp. Port 0 picks a free port.
    #[arg(long, value_name = "HOST:PORT")]
    pub amqp_listen: Option<String>,
    /// STOMP listen address; overrides listeners.stomp.
    #[arg(long, value_name = "HOST:PORT")]
    pub stomp_listen: Option<String>,
    /// MQTT listen address; overrides listeners.mqtt.
    #[arg(long, value_name = "HOST:PORT")]
    pub mqtt_listen: Option<String>,
    /// HTTP (health, management) listen address; overrides listeners.http.
    #[arg(long, value_name = "HOST:PORT")]
    pub http_listen: Option<String>,
    /// AMQP-over-TLS listen address; overrides listeners.amqps (needs --tls-cert/--tls-key).
    #[arg(long, value_name = "HOST:PORT")]
    pub amqps_listen: Option<String>,
    /// STOMP-over-TLS listen address; overrides listeners.stomps.
    #[arg(long, value_name = "HOST:PORT")]
    pub stomps_listen: Option<String>,
    /// MQTT-over-TLS listen address; overrides listeners.mqtts.
    #[arg(long, value_name = "HOST:PORT")]
    pub mqtts_listen: Option<String>,
    /// HTTPS listen address; overrides listeners.https.
    #[arg(long, value_name = "HOST:PORT")]
    pub https_listen: Option<String>,
    /// PEM certificate chain for the TLS listeners; overrides tls.cert_file.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of that certificate; overrides tls.key_file.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle for client certificates; overrides tls.ca_file.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Cut the commitlog at corruption inside a sealed segment instead of refusing to start.
    #[arg(long)]
    pub repair: bool,
    /// A tool to run instead of the broker.
    #[command(subcommand)]
    pub command: Option<Tool>,
}

/// Tools that run instead of the broker.
#[derive(Debug, Subcommand)]
pub enum Tool {
    /// Print a password hash for a `[[users]]` entry's `password_hash` (RabbitMQ's
    /// format: base64 of a random 4-byte salt and SHA-256(salt ++ password)). Without
    /// PASSWORD, the first line of standard input is the password (keeps it out of
    /// the shell history and the process list).
    HashPassword {
        /// The password.
        password: Option<String>,
    },
}

impl Cli {
    /// Applies the flags on top of the file's (or the default) configuration.
    pub fn apply(&self, cfg: &mut Config) {
        if let Some(dir) = &self.data_dir {
            cfg.store.data_dir.clone_from(dir);
        }
        let l = &mut cfg.listeners;
        for (flag, slot) in [
            (&self.amqp_listen, &mut l.amqp),
            (&self.stomp_listen, &mut l.stomp),
            (&self.mqtt_listen, &mut l.mqtt),
            (&self.http_listen, &mut l.http),
            (&self.amqps_listen, &mut l.amqps),
            (&self.stomps_listen, &mut l.stomps),
            (&self.mqtts_listen, &mut l.mqtts),
            (&self.https_listen, &mut l.https),
        ] {
            if let Some(addr) = flag {
                slot.clone_from(addr);
            }
        }
        let t = &mut cfg.tls;
        for (flag, slot) in [
            (&self.tls_cert, &mut t.cert_file),
            (&self.tls_key, &mut t.key_file),
            (&self.tls_ca, &mut t.ca_file),
        ] {
            if flag.is_some() {
                slot.clone_from(flag);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn flags_override_the_file() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "triad",
            "--data-dir",
            "/tmp/x",
            "--amqp-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:8080",
            "--mqtts-listen",
            "127.0.0.1:0",
            "--tls-cert",
            "/etc/c.pem",
            "--tls-key",
            "/etc/k.pem",
            "--repair",
        ])
        .expect("parses");
        let mut cfg = Config::default();
        cli.apply(&mut cfg);
        assert_eq!(cfg.store.data_dir, PathBuf::from("/tmp/x"));
        assert_eq!(cfg.listeners.amqp, "127.0.0.1:0");
        assert_eq!(cfg.listeners.http, "127.0.0.1:8080");
        assert_eq!(cfg.listeners.mqtt, "0.0.0.0:1883");
        assert_eq!(cfg.listeners.mqtts, "127.0.0.1:0");
        assert_eq!(cfg.listeners.amqps, "0.0.0.0:5671");
        assert_eq!(cfg.tls.cert_file, Some(PathBuf::from("/etc/c.pem")));
        assert_eq!(cfg.tls.key_file, Some(PathBuf::from("/etc/k.pem")));
        assert_eq!(cfg.tls.ca_file, None);
        assert!(cli.repair);
        assert!(Cli::try_parse_from(["triad", "--amqp"]).is_err());
        assert!(cli.command.is_none());
    }

    #[test]
    fn hash_password_subcommand() {
        let cli = Cli::try_parse_from(["triad", "hash-password", "s3cret"]).expect("parses");
        assert!(matches!(
            cli.command,
            Some(Tool::HashPassword { password: Some(ref p) }) if p == "s3cret"
        ));
        let cli = Cli::try_parse_from(["triad", "hash-password"]).expect("parses");
        assert!(matches!(
            cli.command,
            Some(Tool::HashPassword { password: None })
        ));
    }
}
