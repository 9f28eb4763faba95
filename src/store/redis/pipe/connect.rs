//! Where a pipelined connection connects and how: the server, TLS, the
//! credentials, the database and the connect timeout of a fred
//! configuration, and the opening of a connection (TCP, TLS over it,
//! `AUTH`, `SELECT`).

use std::time::Duration;

use fred::bytes::BytesMut;
use fred::error::{Error as RedisError, ErrorKind};
use fred::types::config::{Config, CredentialProvider, ServerConfig, TlsConnector};
use redis_protocol::resp2::decode::decode_bytes_mut;
use redis_protocol::resp2::types::BytesFrame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::store::redis::resp::encode;

/// Where to connect, and how.
#[derive(Clone)]
pub struct Target {
    pub(in crate::store::redis) host: String,
    pub(in crate::store::redis) port: u16,
    /// A server on a unix socket (then `host` shows its path, `port` is 0).
    pub(super) unix: Option<std::path::PathBuf>,
    /// `rediss://`: the connector and the name to check.
    pub(super) tls: Option<(tokio_rustls::TlsConnector, String)>,
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    /// Where the credentials are read for each connection instead
    /// (`--redis-password-file`: a password that rotates).
    pub(super) credentials: Option<std::sync::Arc<dyn CredentialProvider>>,
    /// A database other than 0 (`redis://host:port/3`), selected on
    /// every connection before it carries anything.
    pub(super) database: Option<u8>,
    pub(super) connect_timeout: Duration,
}

impl Target {
    /// The one server of `config` (a centralized configuration, as each
    /// primary's is); `None` for anything else, or TLS other than rustls.
    pub fn of(config: &Config, connect_timeout: Duration) -> Option<Self> {
        if let ServerConfig::Unix { path } = &config.server {
            // TLS over a local socket is not offered (url::parse makes none)
            return config.tls.is_none().then(|| Self {
                host: path.display().to_string(),
                port: 0,
                unix: Some(path.clone()),
                tls: None,
                username: config.username.clone(),
                password: config.password.clone(),
                credentials: config.credential_provider.clone(),
                database: config.database.filter(|db| *db != 0),
                connect_timeout,
            });
        }
        let ServerConfig::Centralized { server } = &config.server else {
            return None;
        };
        let tls = match &config.tls {
            None => None,
            Some(tls) => match &tls.connector {
                TlsConnector::Rustls(connector) => {
                    let name = server
                        .tls_server_name
                        .as_ref()
                        .map_or_else(|| server.host.to_string(), |n| n.to_string());
                    Some((connector.clone(), name))
                }
                #[allow(unreachable_patterns)]
                _ => return None,
            },
        };
        Some(Self {
            host: server.host.to_string(),
            port: server.port,
            unix: None,
            tls,
            username: config.username.clone(),
            password: config.password.clone(),
            credentials: config.credential_provider.clone(),
            database: config.database.filter(|db| *db != 0),
            connect_timeout,
        })
    }
}

/// A connection's byte stream: TCP, or TLS over it.
pub(in crate::store::redis) trait Io:
    AsyncRead + AsyncWrite + Unpin + Send
{
}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A connection to `target`, authenticated, within its connect timeout.
pub(in crate::store::redis) async fn open(target: &Target) -> Result<Box<dyn Io>, RedisError> {
    let io = |e: std::io::Error| RedisError::new(ErrorKind::IO, e.to_string());
    let connect = async {
        let mut stream: Box<dyn Io> = match (&target.unix, &target.tls) {
            (Some(path), _) => Box::new(tokio::net::UnixStream::connect(path).await.map_err(io)?),
            (None, tls) => {
                let host = super::super::url::socket_host(&target.host);
                let tcp = TcpStream::connect((host, target.port)).await.map_err(io)?;
                tcp.set_nodelay(true).map_err(io)?;
                match tls {
                    None => Box::new(tcp),
                    Some((connector, name)) => {
                        let name = rustls::pki_types::ServerName::try_from(name.clone())
                            .map_err(|e| RedisError::new(ErrorKind::Tls, e.to_string()))?;
                        Box::new(connector.connect(name, tcp).await.map_err(io)?)
                    }
                }
            }
        };
        match &target.credentials {
            None => {
                if let Some(password) = &target.password {
                    authenticate(&mut stream, target.username.as_deref(), password).await?;
                }
            }
            Some(file) => {
                // the newest password; one refused is read once more (the
                // server may have rotated before the file was replaced)
                // before the connection counts as failed
                let (user, password) = file.fetch(None).await?;
                if let Some(password) = password {
                    if let Err(e) = authenticate(&mut stream, user.as_deref(), &password).await {
                        let (user, again) = file.fetch(None).await?;
                        match again {
                            Some(again) if again != password => {
                                authenticate(&mut stream, user.as_deref(), &again).await?;
                            }
                            _ => return Err(e),
                        }
                    }
                }
            }
        }
        if let Some(db) = target.database {
            let db = db.to_string();
            let command = encode([b"SELECT".as_slice(), db.as_bytes()].into_iter());
            handshake(&mut stream, &command, ErrorKind::Config)
                .await
                .map_err(|e| {
                    RedisError::new(e.kind().clone(), format!("SELECT {db}: {}", e.details()))
                })?;
        }
        Ok(stream)
    };
    tokio::time::timeout(target.connect_timeout, connect)
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::new(
                ErrorKind::Timeout,
                "Redis connect timed out",
            ))
        })
}

/// Sends one command on `stream` and reads its reply (a connection that
/// carries nothing else: a sentinel's, a role check's).
pub(in crate::store::redis) async fn request(
    stream: &mut Box<dyn Io>,
    command: &[&[u8]],
) -> Result<BytesFrame, RedisError> {
    let mut replies = requests(stream, &[command]).await?;
    replies
        .pop()
        .ok_or_else(|| RedisError::new(ErrorKind::Protocol, "no reply"))
}

/// Sends `commands` on `stream` in one write and reads their replies, in
/// order (one round trip for several questions to one server).
pub(in crate::store::redis) async fn requests(
    stream: &mut Box<dyn Io>,
    commands: &[&[&[u8]]],
) -> Result<Vec<BytesFrame>, RedisError> {
    let io = |e: std::io::Error| RedisError::new(ErrorKind::IO, e.to_string());
    let mut out = Vec::new();
    for command in commands {
        out.extend_from_slice(&encode(command.iter().copied()));
    }
    stream.write_all(&out).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut buf = BytesMut::with_capacity(256);
    let mut replies = Vec::with_capacity(commands.len());
    while replies.len() < commands.len() {
        match decode_bytes_mut(&mut buf) {
            Ok(Some((frame, _, _))) => {
                replies.push(frame);
                continue;
            }
            Ok(None) => {}
            Err(e) => return Err(RedisError::new(ErrorKind::Protocol, e.to_string())),
        }
        if stream.read_buf(&mut buf).await.map_err(io)? == 0 {
            return Err(RedisError::new(
                ErrorKind::IO,
                "Redis closed the connection",
            ));
        }
    }
    Ok(replies)
}

/// `AUTH [user] password`.
async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    user: Option<&str>,
    password: &str,
) -> Result<(), RedisError> {
    let mut auth: Vec<&[u8]> = vec![b"AUTH"];
    if let Some(user) = user {
        auth.push(user.as_bytes());
    }
    auth.push(password.as_bytes());
    handshake(stream, &encode(auth.into_iter()), ErrorKind::Auth).await
}

/// Sends `command` and expects `+OK`; an error reply is of `kind`.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    command: &[u8],
    kind: ErrorKind,
) -> Result<(), RedisError> {
    let io = |e: std::io::Error| RedisError::new(ErrorKind::IO, e.to_string());
    stream.write_all(command).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut buf = BytesMut::with_capacity(256);
    loop {
        if stream.read_buf(&mut buf).await.map_err(io)? == 0 {
            return Err(RedisError::new(
                ErrorKind::IO,
                "Redis closed the connection",
            ));
        }
        match decode_bytes_mut(&mut buf) {
            Ok(Some((BytesFrame::SimpleString(_), _, _))) => return Ok(()),
            Ok(Some((BytesFrame::Error(e), _, _))) => {
                return Err(RedisError::new(kind, e.to_string()))
            }
            Ok(Some(_)) => {
                return Err(RedisError::new(
                    ErrorKind::Protocol,
                    "unexpected reply to AUTH",
                ))
            }
            Ok(None) => {}
            Err(e) => return Err(RedisError::new(ErrorKind::Protocol, e.to_string())),
        }
    }
}
