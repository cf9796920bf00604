"""The proxy data path: HTTP/1.1 framing and keep-alive connections on raw asyncio protocols.

This is serving's surface for other packages (the runtime's front proxies its engine on
it, as the router proxies pods), and it needs nothing else of serving but its errors, so an
image that runs only the front carries ``serving/wire`` and ``serving/errors.py``:

* ``http1``: request and response heads, chunked bodies (parsing only, no I/O);
* ``proxy``: the client and backend connection protocols, the backend connection pool, and
  the ``Dispatcher`` interface through which a server decides where each request goes.
"""

from serving.wire.http1 import RequestHead, ResponseHead
from serving.wire.proxy import ClientConn, Dispatcher, Pool, local_response

__all__ = ["ClientConn", "Dispatcher", "Pool", "RequestHead", "ResponseHead", "local_response"]
