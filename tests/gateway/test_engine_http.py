"""The gateway's HTTP client to engines, against a scripted server: lines that arrived together are known to be
ready (the relay sends their chunks in one write), a line still on its way is not."""

import asyncio

from gateway.engine_http import EngineHTTP


def test_line_ready_says_whether_the_next_line_has_arrived():
    async def main():
        more = asyncio.Event()

        async def server(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
            body = b'{"n": 1}\n{"n": 2}\n\n'  # two lines and a blank one, in one write
            writer.write(b"%x\r\n%b\r\n" % (len(body), body))
            await writer.drain()
            await more.wait()
            body = b'{"n": 3}\n'
            writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
            await writer.drain()

        fake = await asyncio.start_server(server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{fake.sockets[0].getsockname()[1]}/v1/generate"
        response = await EngineHTTP(connect_timeout=5, read_timeout=5).request("POST", url, headers={}, body=b"{}")
        seen = []
        async for line in response.aiter_lines():
            seen.append((line, response.line_ready()))
            if line == '{"n": 2}':
                more.set()
        fake.close()
        return seen

    assert asyncio.run(main()) == [('{"n": 1}', True), ('{"n": 2}', False), ("", False), ('{"n": 3}', False)]
