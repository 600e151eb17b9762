"""Where the server keeps outputs between requests: the images behind ``response_format="url"``
links (`image_store`) and the Videos API's jobs and files (`video_store`)."""
