"""Worker processes: the frontend side (:mod:`.process`) and the process entry (:mod:`.main`)."""
