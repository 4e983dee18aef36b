//! The `callbackd` command: run the server, check a config, or operate a running server
//! through its admin API.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use callbackd::app::Settings;
use callbackd::config::{Config, LogFormat};
use callbackd::store::Partitions;

/// glibc's allocator took about a quarter of callbackd's CPU under ingest (BENCHMARKS.md,
/// "callbackd allocations"): a request allocates and frees many small buffers across the
/// runtime's threads, which mimalloc's per-thread free lists serve without glibc's locking
/// and consolidation.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ADMIN_TOKEN_ENV: &str = "CALLBACKD_ADMIN_TOKEN";
const URL_ENV: &str = "CALLBACKD_URL";

#[derive(Parser)]
#[command(
    name = "callbackd",
    version,
    about = "Makes payment callbacks safe to retry: verifies and dedupes provider callbacks, \
             delivers connector notifications with retries for 7 days, lets operators replay.",
    after_help = "Start with `callbackd check-config`, then `callbackd serve`.\n\
                  Config: --config PATH, else $CALLBACKD_CONFIG, else ./config.toml; any key can be \
                  overridden by CALLBACKD__SECTION__KEY (e.g. CALLBACKD__STORE__URL=redis://127.0.0.1:6379/0)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct ConfigArg {
    /// Config file [default: $CALLBACKD_CONFIG, else ./config.toml]
    #[arg(long, short)]
    config: Option<PathBuf>,
}

#[derive(Args)]
struct Remote {
    /// Base URL of a running callbackd
    #[arg(long, env = URL_ENV, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Admin token (one of auth.admin_tokens); read from the environment so it stays out of
    /// shell history and process lists
    #[arg(long = "token-env", default_value = ADMIN_TOKEN_ENV, value_name = "VAR")]
    token_env: String,
}

/// Which messages: the filters shared by `messages list` and `resend`.
#[derive(Args)]
struct Selection {
    /// pending, in_flight, delivered, dead or recorded
    #[arg(long)]
    state: Option<String>,
    /// Source name (inbound callbacks)
    #[arg(long)]
    source: Option<String>,
    /// Payment id (connector notifications)
    #[arg(long)]
    payment_id: Option<String>,
    /// Provider transaction id (its events in --source, or in every source)
    #[arg(long)]
    transaction_id: Option<String>,
    /// Created at or after: RFC 3339 with an offset, e.g. 2026-11-30T00:00:00-03:00
    #[arg(long)]
    from: Option<String>,
    /// Created at or before: RFC 3339 with an offset
    #[arg(long)]
    to: Option<String>,
}

impl Selection {
    /// The API's names for the given filters.
    fn fields(self) -> Vec<(&'static str, String)> {
        [
            ("state", self.state),
            ("source", self.source),
            ("paymentId", self.payment_id),
            ("transactionId", self.transaction_id),
            ("createdAtFrom", self.from),
            ("createdAtTo", self.to),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.map(|v| (name, v)))
        .collect()
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP server and the delivery workers until SIGTERM or Ctrl-C
    Serve(ConfigArg),
    /// Load and validate the config, print a summary, exit 0 (or 2 naming the bad key)
    CheckConfig(ConfigArg),
    /// GET /healthz of a running server (a container HEALTHCHECK): exit 0 when it answers 2xx
    /// within the timeout, else 1
    Healthcheck {
        /// Base URL [default: loopback at the port of server.listen in the config]
        #[arg(long, env = URL_ENV)]
        url: Option<String>,
        #[command(flatten)]
        config: ConfigArg,
        /// Seconds to wait for the answer
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
        timeout_secs: u64,
    },
    /// Post a test callback, signed with the source's configured secret as its provider would:
    ///   callbackd send-test --source payzu
    ///   callbackd send-test --source payzu --id tx-1001 --status REFUNDED
    #[command(verbatim_doc_comment)]
    SendTest(callbackd::cli::SendTestArgs),
    /// Inspect messages of a running server (needs $CALLBACKD_ADMIN_TOKEN)
    Messages {
        #[command(subcommand)]
        command: MessagesCommand,
    },
    /// Deliver messages once more. Examples:
    ///   callbackd resend --id msg_0192...
    ///   callbackd resend --payment-id pay-123
    ///   callbackd resend --from 2026-11-30T00:00:00Z --to 2026-11-30T12:00:00Z --state dead
    /// Give --request-id to make a retried command resend nothing twice.
    #[command(verbatim_doc_comment)]
    Resend {
        #[command(flatten)]
        remote: Remote,
        /// Message id; repeat for several
        #[arg(long = "id")]
        ids: Vec<String>,
        #[command(flatten)]
        selection: Selection,
        /// Makes a retried command resend nothing twice
        #[arg(long)]
        request_id: Option<String>,
    },
    /// Ask a source's provider to resend its callbacks of a time range (PayZu's
    /// `POST /user/callbacks/resend`, in windows of at most 7 days, at most 30 days back),
    /// then report how many that arrived were new events and how many replays:
    ///   callbackd recover --source payzu --from 2026-11-10T00:00:00Z --to 2026-11-30T00:00:00Z --wait 600
    #[command(verbatim_doc_comment)]
    Recover {
        #[command(flatten)]
        remote: Remote,
        /// Source whose provider resends (needs provider_api_url and provider_api_token)
        #[arg(long)]
        source: String,
        /// Start of the range (inclusive): RFC 3339 with an offset
        #[arg(long)]
        from: String,
        /// End of the range (exclusive): RFC 3339 with an offset
        #[arg(long)]
        to: String,
        /// Seconds to follow the report: polls it until its figures stop changing or this
        /// ends, then prints it [default: print the report at once]
        #[arg(long, value_name = "SECS")]
        wait: Option<u64>,
        /// How long the server counts the source's arrivals for the report, 1 to 86400
        /// [default: 3600]
        #[arg(long)]
        count_secs: Option<u64>,
    },
}

#[derive(Subcommand)]
enum MessagesCommand {
    /// List messages, oldest first: a table on a terminal, else (or with --json) the API's
    /// JSON with `nextCursor` for the next page
    List {
        /// Print the API's JSON even on a terminal
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
        #[command(flatten)]
        selection: Selection,
        /// Messages per page, 1 to 1000
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// `nextCursor` from the previous page
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show one message with every delivery attempt
    Show {
        #[command(flatten)]
        remote: Remote,
        id: String,
    },
}

fn load_config(arg: &ConfigArg) -> Result<Config, String> {
    Config::load(arg.config.as_deref(), std::env::vars()).map_err(|e| e.to_string())
}

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&config.log.level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only on a terminal: in a file or a collector they are noise around every
    // field name.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match config.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn serve(arg: ConfigArg) -> Result<(), String> {
    let config = load_config(&arg)?;
    init_logging(&config);
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .map_err(|e| {
            format!(
                "cannot listen on {} (server.listen): {e}",
                config.server.listen
            )
        })?;
    tracing::info!(listen = %config.server.listen, store = %store_kind(&config), "callbackd starting");
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    callbackd::run(config, listener, shutdown)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!("callbackd stopped");
    Ok(())
}

fn store_kind(config: &Config) -> &'static str {
    match config.store_location() {
        Ok(callbackd::config::StoreLocation::Sqlite(_)) => "sqlite",
        Ok(callbackd::config::StoreLocation::Redis(_)) => "redis",
        Ok(callbackd::config::StoreLocation::Postgres(_)) => "postgres",
        Err(_) => "invalid",
    }
}

async fn cancel_on_signal(token: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    let _ = ctrl_c.await;
                    token.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested: finishing in-flight work");
    token.cancel();
}

fn check_config(arg: ConfigArg) -> Result<(), String> {
    let config = load_config(&arg)?;
    // What `serve` would derive, so a config that loads but cannot start is refused here too.
    let settings = Settings::from_config(&config).map_err(|e| e.to_string())?;
    println!(
        "config OK: listen {}, store {} ({}), {} source(s): {}, {} connector token(s), {} admin token(s)",
        config.server.listen,
        store_kind(&config),
        config.store.url.split('@').next_back().unwrap_or_default(),
        config.sources.len(),
        config
            .sources
            .keys()
            .cloned()
            .collect::<Vec<_>>()
            .join(", "),
        config.auth.connector_tokens.len(),
        config.auth.admin_tokens.len(),
    );
    let store = &settings.store;
    println!(
        "retention: dedupe claims and finished messages {}, payment states {} after their \
         last transition; expired data swept every {}",
        humantime::format_duration(store.dedupe_ttl),
        humantime::format_duration(store.payment_retention),
        humantime::format_duration(store.sweep_interval),
    );
    match store.partitions {
        Some(count) => println!(
            "partitions: {count} (store.partitions); a store that records another count is refused"
        ),
        None => println!(
            "partitions: the store's own (store.partitions not set): {} for a new store, 16 \
             for one created before the count was recorded",
            Partitions::DEFAULT
        ),
    }
    // Which sources a recovery can reach; the URL is shown, never the token.
    for (name, source) in &config.sources {
        if let Some(url) = &source.provider_api_url {
            println!(
                "recovery: source {name} reaches its provider's API at {} (callbackd recover)",
                callbackd::redact::url_credentials(url)
            );
        }
    }
    Ok(())
}

async fn healthcheck(
    url: Option<String>,
    config: ConfigArg,
    timeout_secs: u64,
) -> Result<(), String> {
    let base = match url {
        Some(url) => url,
        None => local_url(load_config(&config)?.server.listen),
    };
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(timeout_secs))
        .build()
        .map_err(|e| e.to_string())?;
    let url = format!("{}/healthz", base.trim_end_matches('/'));
    let response = client
        .get(&url)
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("{url} answered {}", response.status()))
    }
}

/// Where a process on this machine reaches a server listening on `listen`: a wildcard
/// address is not one to connect to, loopback on the same port is.
fn local_url(listen: SocketAddr) -> String {
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, listen.port()))
}

async fn call_admin(
    remote: &Remote,
    method: reqwest::Method,
    path: &str,
    query: &[(&str, String)],
    body: Option<Value>,
    print: bool,
) -> Result<Value, String> {
    call_admin_within(remote, method, path, query, body, print, ADMIN_CALL_TIMEOUT).await
}

/// How long an admin call may take, unless it says otherwise.
const ADMIN_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// A recovery's POST answers once every window was sent, each with up to three tries of ten
/// seconds: five windows can take minutes.
const RECOVERY_CALL_TIMEOUT: Duration = Duration::from_secs(300);

async fn call_admin_within(
    remote: &Remote,
    method: reqwest::Method,
    path: &str,
    query: &[(&str, String)],
    body: Option<Value>,
    print: bool,
    timeout: Duration,
) -> Result<Value, String> {
    let token = std::env::var(&remote.token_env).map_err(|_| {
        format!(
            "set ${} to an admin token (auth.admin_tokens)",
            remote.token_env
        )
    })?;
    let client = reqwest::Client::builder()
        // Like deliveries, the CLI ignores HTTP(S)_PROXY / ALL_PROXY: it talks to one
        // callbackd, and an admin token should not pass through a proxy nobody configured here.
        .no_proxy()
        .timeout(timeout)
        .build()
        .map_err(|e| e.to_string())?;
    let url = format!("{}{path}", remote.url.trim_end_matches('/'));
    let mut request = client.request(method, &url).bearer_auth(token).query(query);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let status = response.status();
    let text = response.text().await.map_err(|e| e.to_string())?;
    let value = serde_json::from_str::<Value>(&text).ok();
    let pretty = value
        .as_ref()
        .and_then(|v| serde_json::to_string_pretty(v).ok())
        .unwrap_or(text);
    if status.is_success() {
        if print {
            println!("{pretty}");
        }
        Ok(value.unwrap_or(Value::Null))
    } else {
        Err(format!("{status}: {pretty}"))
    }
}

async fn messages(command: MessagesCommand) -> Result<(), String> {
    match command {
        MessagesCommand::List {
            json,
            remote,
            selection,
            limit,
            cursor,
        } => {
            let mut q = selection.fields();
            q.push(("limit", limit.to_string()));
            q.extend(cursor.map(|c| ("cursor", c)));
            let table = !json && std::io::IsTerminal::is_terminal(&std::io::stdout());
            let page = call_admin(
                &remote,
                reqwest::Method::GET,
                "/v1/messages",
                &q,
                None,
                !table,
            )
            .await?;
            if table {
                print!("{}", callbackd::cli::render_table(&page));
            }
            Ok(())
        }
        MessagesCommand::Show { remote, id } => {
            let path = format!("/v1/messages/{id}");
            call_admin(&remote, reqwest::Method::GET, &path, &[], None, true)
                .await
                .map(drop)
        }
    }
}

/// `callbackd recover`: starts the recovery, then, with `--wait`, polls its report until its
/// figures stop changing (the same twice, 2 s apart) or reach what the provider said it would
/// resend, or the wait ends; prints the report as a summary and the API's JSON.
async fn recover(remote: Remote, body: Value, wait: Option<u64>) -> Result<(), String> {
    let started = call_admin_within(
        &remote,
        reqwest::Method::POST,
        "/v1/admin/recoveries",
        &[],
        Some(body),
        false,
        RECOVERY_CALL_TIMEOUT,
    )
    .await?;
    let id = started["id"]
        .as_str()
        .ok_or("the server's answer has no recovery id")?
        .to_string();
    let mut report = started;
    if let Some(wait) = wait {
        let until = tokio::time::Instant::now() + Duration::from_secs(wait);
        let figures = |r: &Value| (r["new"].clone(), r["replays"].clone());
        let mut last = figures(&report);
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() || report["counting"] == Value::Bool(false) {
                break;
            }
            tokio::time::sleep(left.min(RECOVERY_POLL)).await;
            report = call_admin(
                &remote,
                reqwest::Method::GET,
                &format!("/v1/admin/recoveries/{id}"),
                &[],
                None,
                false,
            )
            .await?;
            let now = figures(&report);
            let arrived = now.0.as_u64().unwrap_or(0) + now.1.as_u64().unwrap_or(0);
            // Everything the provider said it would resend has arrived, or nothing more came
            // in a poll's time after something did.
            let requested = report["requested"].as_u64().unwrap_or(0);
            if (requested > 0 && arrived >= requested) || (now == last && arrived > 0) {
                break;
            }
            last = now;
        }
    }
    print!("{}", callbackd::cli::render_recovery(&report));
    println!(
        "{}",
        serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
    );
    let failed = report["failedWindows"].as_u64().unwrap_or(0);
    if failed > 0 {
        return Err(format!("{failed} window(s) failed: see their errors above"));
    }
    Ok(())
}

/// How often `recover --wait` reads the report.
const RECOVERY_POLL: Duration = Duration::from_secs(2);

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(arg) => serve(arg).await,
        Command::CheckConfig(arg) => check_config(arg),
        Command::Healthcheck {
            url,
            config,
            timeout_secs,
        } => {
            // Docker reads 1 as unhealthy and reserves 2, so this one exits 1 on any failure.
            return match healthcheck(url, config, timeout_secs).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(message) => {
                    eprintln!("callbackd: unhealthy: {message}");
                    ExitCode::FAILURE
                }
            };
        }
        Command::SendTest(args) => callbackd::cli::send_test(args).await,
        Command::Messages { command } => messages(command).await,
        Command::Resend {
            remote,
            ids,
            selection,
            request_id,
        } => {
            let mut body: serde_json::Map<String, Value> = selection
                .fields()
                .into_iter()
                .map(|(name, value)| (name.to_string(), Value::String(value)))
                .collect();
            if !ids.is_empty() {
                body.insert("messageIds".into(), json!(ids));
            }
            if let Some(r) = request_id {
                body.insert("requestId".into(), Value::String(r));
            }
            call_admin(
                &remote,
                reqwest::Method::POST,
                "/v1/admin/resend",
                &[],
                Some(Value::Object(body)),
                true,
            )
            .await
            .map(drop)
        }
        Command::Recover {
            remote,
            source,
            from,
            to,
            wait,
            count_secs,
        } => {
            let mut body = json!({"source": source, "from": from, "to": to});
            if let Some(secs) = count_secs {
                body["countSecs"] = json!(secs);
            }
            recover(remote, body, wait).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("callbackd: {message}");
            ExitCode::from(2)
        }
    }
}
