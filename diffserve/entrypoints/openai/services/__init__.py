"""The generation services behind the routes: images (`images`, with the edits' multipart
parser in `edits`), videos (`videos`: the Videos API jobs), video streams (`video_streams`:
chunked video over SSE with mid-stream interactions), the engine requests of one HTTP request
(`request_groups`) and the SSE progress events of a request (`sse_progress`)."""
