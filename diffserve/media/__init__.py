"""Media encoding: images (`image_encoding`: PNG/JPEG/WebP), videos (`video_encoding`: MP4,
animated WebP, GIF) and the generation metadata they carry (`metadata`)."""
